"""Tests of the platform speed-ups (milestones/kernels), and what they share."""

from __future__ import annotations

import torch


def assert_one_opaque_op_to_torch_compile(op, args: tuple, name: str) -> None:
    """A registered op with a shape rule: ``opcheck`` passes, and torch.compile traces it in one graph, unbroken."""
    torch.library.opcheck(op.default, args)
    graphs = []

    def count_graphs(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(lambda *a: op(*a) * 2, backend=count_graphs, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(*args), op(*args) * 2)
    assert len(graphs) == 1 and name in str(graphs[0].graph)
