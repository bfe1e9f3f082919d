"""Programs that run on each TPU VM worker, started by the launchers' one `gcloud ... ssh --worker=all`
(experiments/launcher/pod.py) from the repository on the worker, `python -m experiments.launcher.worker.<tool>`;
each tool's job: docs/ARCHITECTURE.md, "Where things are".

Standard library only (tpu_check, and the trainer a resident imports, aside), and Python 3.10
syntax: `stop`, `status` and `checkout` run with the system python3 (so that they work while the
repo's .venv is broken or not there yet), which is 3.10 on the TPU VM images.
A worker's answer is one tagged line (runtime/wire.py), which the launcher finds anywhere in
gcloud's interleaved output.
"""

SECRETS_PREFIX = ".podrunner-secrets-"  # + a random token: the secrets file in each worker's home
