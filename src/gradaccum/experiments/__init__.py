"""The seed experiment: MNIST, Adam, one update per 100 samples split as k x b.

Modules: `data` (MNIST loading), `models` (networks and optimizers), `runner` (runs of
one configuration), `report` (table, results files, figure). The command line in
`gradaccum.cli` drives them; see docs/experiment.md.
"""
