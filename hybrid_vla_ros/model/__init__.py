"""Model side: checkpoint config and presets, the VLA as ordered blocks, its stages at a split layer, loaders."""
