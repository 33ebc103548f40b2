"""Cost models: what a strategy costs on a cluster, as pure functions of plain data.

facts (the op graph condensed into pipeline units) → compute (roofline with GEMM-shape efficiency)
and communication (NCCL's ring/tree α-β model) → stage costs → pipeline schedule → step time,
memory and the collective ledger (`evaluate`, `collectives`); `implementation` prices other
software's kernels and overlap (`--strategy attention=math,...`), the searcher (`autopar.searcher.candidates`)
completes a partial strategy.
"""
