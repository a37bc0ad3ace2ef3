"""The ``hybrid-vla`` command and what it runs: replay (the main job), plots, bench."""
