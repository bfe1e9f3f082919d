"""Programs that run on each TPU VM worker, started by the launchers' one `gcloud ... ssh --worker=all`
(experiments/launcher/pod.py) from the repository on the worker, `python -m experiments.launcher.worker.<tool>`:

  stop      end this login's training processes and TPU holders, free the libtpu lockfile
  status    this worker's training processes, last step and newest log, as one tagged line
  versions  this worker's commit, Python and package versions, and whether they fit the pins
  pins      warn when a shipped tree pins other packages than the worker's .venv has
  once      start the trainer once per launch, however often gcloud re-runs the command

Standard library only, and Python 3.10 syntax: `stop` and `status` run with the system python3
(so that they work while the repo's .venv is broken), which is 3.10 on the TPU VM images.
A worker's answer is one line, `<tag>{json}` (the tags below), which the launcher finds anywhere
in gcloud's interleaved output.
"""

STATUS_TAG = "podrunner-status "
VERSIONS_TAG = "podrunner-versions "
START_TAG = "podrunner-start "
