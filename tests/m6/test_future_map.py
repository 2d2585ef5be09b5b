"""m6's future map on its own: ids around a ring, tokens stored where the next step finds them."""

from __future__ import annotations

import torch

from milestones.m6.future_map import FutureMap

CPU = torch.device("cpu")


def test_future_ids_are_negative_and_wrap_around_the_ring():
    futures = FutureMap(4, CPU)
    first = futures.allocate(3)
    assert first == [-1, -2, -3], f"the first 3 future ids are {first}, expected [-1, -2, -3]: -1 - i for place i"
    second = futures.allocate(3)
    assert second == [-4, -1, -2], (
        f"the next 3 are {second}, expected [-4, -1, -2]: the ring has four places, so after -4 the ids start "
        "again at -1 (-1 - (self.next + i) % size, and self.next goes round the ring too)"
    )
    assert futures.allocate(0) == [], "allocate(0) hands out no id: []"


def test_store_puts_each_token_at_its_ids_place():
    futures = FutureMap(6, CPU)
    futures.store([-1, -4, -6], torch.tensor([11, 44, 66]))
    assert futures.tokens.tolist() == [11, 0, 0, 44, 0, 66], (
        f"after store([-1, -4, -6], [11, 44, 66]) the ring holds {futures.tokens.tolist()}, expected "
        "[11, 0, 0, 44, 0, 66]: future id f is place -1 - f of self.tokens (-1 is place 0), not f itself"
    )
    futures.store([], torch.tensor([], dtype=torch.long))
    assert futures.tokens.tolist() == [11, 0, 0, 44, 0, 66], "store with no future ids changes nothing"


def test_resolve_replaces_only_future_ids_by_their_stored_tokens():
    futures = FutureMap(6, CPU)
    first = futures.allocate(2)
    futures.store(first, torch.tensor([101, 102]))
    second = futures.allocate(3)
    futures.store(second, torch.tensor([201, 202, 203]))
    input_ids = torch.tensor([7, second[2], first[0], 0, second[0], first[1]])
    try:
        futures.resolve_(input_ids)  # in place: the step's input buffer itself
    except IndexError as error:
        raise AssertionError(
            f"resolve_ raised IndexError ({error}) on input ids {input_ids.tolist()} with a ring of 6: a token id "
            "(>= 0, here 7) is no place of the ring; look every entry up at (-1 - input_ids).clamp(min=0), so a "
            "real token reads place 0 (then torch.where keeps the token itself)"
        ) from error
    assert input_ids.tolist() == [7, 203, 101, 0, 201, 102], (
        f"after resolve_ the input ids are {input_ids.tolist()}, expected [7, 203, 101, 0, 201, 102]: each "
        "negative id becomes self.tokens[-1 - id], written into the caller's tensor itself (input_ids.copy_), "
        "and ids >= 0 stay"
    )


def test_a_later_step_overwrites_a_slot_only_after_the_ring_wraps():
    futures = FutureMap(2, CPU)
    ids = futures.allocate(2)
    futures.store(ids, torch.tensor([5, 6]))
    again = futures.allocate(1)
    assert again == [ids[0]]
    futures.store(again, torch.tensor([9]))
    input_ids = torch.tensor(ids)
    futures.resolve_(input_ids)
    assert input_ids.tolist() == [9, 6], (
        f"resolved to {input_ids.tolist()}, expected [9, 6]: the ring wrapped, so place 0 now holds the later 9"
    )
