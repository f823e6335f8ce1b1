"""Exports: a trained drafter written in a layout serving engines load (folder.py: write, read back,
validate, load), with its model card (card.py). The layouts themselves belong to the drafters that
own them (drafters/<name>.py registers them; shared writers in drafters/parts/layouts.py)."""
