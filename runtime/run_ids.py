"""Run ids, shared by the trainer (runtime/trainer.py) and the pod launcher (experiments/launcher/pod.py),
which imports this without pulling in JAX."""

import re

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # W&B-safe, and a directory name on the workers
PROPOSED_RUN_ID_ENV = "PODRUNNER_RUN_ID"  # set by the pod launcher: a fresh run's id, never a resumed one's
