"""What every command of specdistill shares, below every other floor: user errors in one line
(errors.py), output paths and the config folder (paths.py), settings' ranges (ranges.py), and the
`specdistill <verb>` command itself (main.py)."""
