"""Supervision that is no milestone's lesson, written once: worker processes, torchrun's variables, and the
thread that computes m6's steps (``threads.InOrderThread``).

A lesson keeps what its idea needs (m8: which ranks exist, what each loads, the steps it serves); starting a
process, hearing that it is ready, naming one that died, stopping them together and leaving none behind is the
same for every engine that has workers, and lives here. Dependencies point one way: milestones import this
package, never the reverse.
"""
