"""Cost models: pure functions of (graph facts, hardware facts, strategy); the searcher chooses.

    facts           the op graph condensed into units with tp-aware per-op facts
    compute         roofline time per unit (Efficiency: the documented or calibrated fractions of peak)
    communication   collective times on the cluster's links (ring formulas at NCCL bus bandwidth)
    collectives     the ledger: which collectives a step sends, per mesh axis (what the runtime counts)
    memory          parameters, gradients, optimizer states, activations per rank
    recompute       per-stage recompute policies and the fewest recomputed layers that fit
    pipeline        schedule simulation (GPipe, 1F1B, interleaved) and its closed-form estimate
    evaluate        one strategy priced end to end: step time, memory, breakdown
    calibration     the roofline fitted to a profile database
    strategy        parsing and checking --strategy
"""
