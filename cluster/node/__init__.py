"""Code that runs ON a node, sent over the link as source: stdlib only, Python >= 3.8, no UGRO install."""
