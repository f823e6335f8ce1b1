"""Folders on disk that specdistill writes and reads back: a drafter folder (drafter.py), a training
run dir and what a path to one means (rundir.py), and how every folder is written (atomic.py: all or
nothing) and verified (manifest.py: every file's size and sha256)."""
