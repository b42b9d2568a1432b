"""Analysis: pure functions from snapshots to evidence records and verdicts.

No I/O and no sentences: the wait-for graph and the no-waker proof, progress and when it last
happened, front doors and what leaves a service, GPU shapes, the classifier and the culprit.
"""
