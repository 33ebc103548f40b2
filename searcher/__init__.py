"""The plan search: outer enumeration of strategies, intra-op sharding ILP, inter-op stage DP.

    candidates      every completion of the fixed keys the runtime can run, ranked by the closed-form estimate
    intra_op        the Alpa-style sharding ILP per distinct unit (its math in its docstring)
    intra_op_rules  the runtime's tp placement rules as ILP constraints
    memory_budget   a layer's share of device memory, the ILP's memory row
    inter_op        the dynamic program cutting units into pipeline stages
    refiner         one ranked strategy made a candidate: ILP placements, dry runs, stages, exact evaluation
    search          the composition: rank, refine the best few, keep the fastest plan that fits
    tp_placements   each parameter's tp placement in a plan; whether Megatron's layout runs
    why_not         the runners-up and obvious alternatives, each with why it loses, in numbers
    plan_builder    the chosen candidate as a Plan (autopar.plan_schema)
"""
