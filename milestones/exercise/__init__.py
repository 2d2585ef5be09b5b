"""Build a milestone yourself: a skeleton to fill in, checked by the project's own tests.

    python -m milestones.exercise start m3 [--to workspace/m3] [--no-hints] [--extras]  # make exercise M=m3 [HINTS=0]
    python -m milestones.exercise check m3 [--impl DIR] [--step N | --steps A-B]  # or: make check M=m3 [STEP=n]

``start`` copies the reference package ``milestones/mK`` (the previous milestone plus
the lesson's changes), with the shared serving layer beside it in ``serving/`` (its optional
steps are written there), and replaces the body of every function that *is* the lesson by
``raise NotImplementedError``, with a TODO saying what to build (the contract, then how,
unless ``--no-hints``) and which step checks it. The optional steps after the core (serving features such as
penalties and log-probabilities) come filled in unless ``--extras``. The lesson's functions are named in
``milestones/course/`` (``mK.py`` for milestone mK) by the snippet sections the docs already show, so skeletons are
generated from the reference and never drift.

``check`` runs the milestone's suite against the learner's package, one step at a time
from the smallest piece to the whole engine (the last steps compare it token for token
with the reference m(K-1) and run the contract every milestone keeps), stops at the first
step that fails, and prints "k of n steps pass". The steps run in this process, one pytest
session each, so torch and the tests are imported once. The tests import the learner's
package in place of ``milestones.mK`` (``install.install``, called by the tests' conftest when
``MILESTONE_IMPL`` is set).

The modules, in the order a learner meets them: ``stubs`` finds the lesson's functions in the reference and
replaces their bodies, ``skeleton`` writes the learner's package (``start``), ``install`` puts it in the place of
``milestones.mK``, ``session`` runs one step's tests, ``failures`` finds the step that owns a failure, ``check``
runs the steps and reports, and ``cli`` is the command line (``__main__``). Only paths live here, so that
``milestones/__init__.py`` can import ``install`` without the rest.
"""

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # milestones/: the reference packages
REPO_ROOT = PACKAGE_ROOT.parent
SHARED = "serving"  # the shared layer a skeleton holds a copy of (milestones/serving), its optional steps' files
