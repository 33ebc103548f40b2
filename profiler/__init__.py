"""Per-operator and collective profiling (issue #3): measured numbers for the cost models.

    signatures      op graph nodes -> distinct operator signatures, plus the sharded shapes (tp, micro-batch)
    operators       time one signature on cpu or cuda (random inputs, warm-up, median; GPU memory)
    database        the SQLite profile database keyed by device, dtype, torch version and signature
    collectives     α-β fits of NCCL/gloo collectives per link level (under torchrun)
    graph_profile   profile a whole graph into the database; price a step back from it
    cli             `autopar profile`
"""

from autopar.profiler.database import ProfileDB
from autopar.profiler.records import CollectiveFit, OpRecord, OpTiming
from autopar.profiler.signatures import OpSignature, scale_signature, sharded_variants, signature_of, unique_signatures

__all__ = [
    "CollectiveFit", "OpRecord", "OpSignature", "OpTiming", "ProfileDB", "scale_signature", "sharded_variants",
    "signature_of", "unique_signatures",
]
