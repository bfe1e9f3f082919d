"""Programs that run on each TPU VM worker, `python -m experiments.launcher.worker.<tool>` from the repo
there (docs/ARCHITECTURE.md, "Where things are").

Standard library only (tpu_check and doctor_checks aside) and Python 3.10 syntax: `stop`, `status`
and `checkout` run with the system python3 (3.10 on the TPU VM images), so they work while the
repo's .venv is broken or not there yet. A worker's answer is one tagged line (runtime/wire.py).
"""

SECRETS_PREFIX = ".podrunner-secrets-"  # + a random token: the secrets file in each worker's home
