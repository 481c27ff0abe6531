"""This pipeline and SpecForge 0.2 side by side: on the toy target (`compare`) and at the 8B
shape (`scale`); the other modules are their steps."""
