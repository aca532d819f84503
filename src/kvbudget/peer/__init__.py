"""NVIDIA kvpress, run beside kvbudget: its environment (:mod:`kvbudget.peer.environment`) and the
standalone runner its Python executes (:mod:`kvbudget.peer.kvpress_runner`, which imports no kvbudget
module). Evaluation rows and benchmarks build on it."""
