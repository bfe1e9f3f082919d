"""Programs that run on each TPU VM worker, started by the launchers' one `gcloud ... ssh --worker=all`
(experiments/launcher/pod.py) from the repository on the worker, `python -m experiments.launcher.worker.<tool>`:

  stop      end this login's training processes and TPU holders, free the libtpu lockfile
  status    this worker's training processes, last step and newest log, as one tagged line
  versions  this worker's commit, Python and package versions, and whether they fit the pins
  once      a launch: start the trainer once per launch, however often gcloud re-runs the command
            (the secrets, the environment, the log; with --ship the shipped tree: shipped.py;
            with --resident, start a resident trainer or hand the job to it: resident.py)
  resident  a trainer process that stays after its job and runs the slice's next ones (the repo's
            .venv python: it imports the trainer)
  checkout  `setup --git-ref`: fetch, then check out the remote branch (or the tag, the commit)
  tpu_check setup_tpu.sh's check that jax sees this worker's TPU devices (imports jax: the .venv's
            python)

Standard library only (tpu_check, and the trainer a resident imports, aside), and Python 3.10
syntax: `stop`, `status` and `checkout` run with the system python3 (so that they work while the
repo's .venv is broken or not there yet), which is 3.10 on the TPU VM images.
A worker's answer is one line, `<tag>{json}` (the tags below), which the launcher finds anywhere
in gcloud's interleaved output.
"""

STATUS_TAG = "podrunner-status "
VERSIONS_TAG = "podrunner-versions "
START_TAG = "podrunner-start "
SECRETS_PREFIX = ".podrunner-secrets-"  # + a random token: the secrets file in each worker's home
