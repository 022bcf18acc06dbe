"""An emulated cluster on one machine: network namespaces as nodes, ``tbf``-capped links.

- :mod:`flashsgd.emulate.netns`: build / tear down namespaces, bridge, veths, shaping; stale cleanup.
- :mod:`flashsgd.emulate.ranks`: start a command as every rank, in its node's namespace.
- :mod:`flashsgd.emulate.store`: the job's rendezvous store, hosted apart from the ranks.
- :mod:`flashsgd.emulate.probe`: per-rank all-reduce check and per-link byte counts.
- :mod:`flashsgd.emulate.report`: physical bound, fraction of it, link usage, the table.

The command is ``flashsgd bench emulate`` (:mod:`flashsgd.bench.emulate`).
"""
