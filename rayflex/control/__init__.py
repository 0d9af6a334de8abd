"""The control plane of one run: the controller and the states it moves through."""
