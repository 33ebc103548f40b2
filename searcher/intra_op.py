"""Intra-op ILP: a tensor-parallel sharding strategy for every op of one pipeline unit.

A proposal generator: the searcher takes the parameter placements it chooses, checks the runtime
can run them, and prices them as the runtime runs them (`cost_models.placed_collectives.placed_units`,
the evaluator Megatron candidates go through). Its own objective below ranks shardings inside one
unit only; it is not a plan's predicted cost (it knows neither the runtime's module-by-module
collectives nor the vocabulary-parallel loss, and solves a tied embedding and head separately).

One unit (a layer instance, solved once per layer type, or the pre/post unit) on a 1-D mesh axis
of `tp` ranks; placements are DTensor's R, S(d), P per tensor; candidate strategies per op are
derived as DTensor derives its op strategies (`searcher.intra_op_strategies` lists them). After
Alpa's intra-op pass (Zheng et al., "Alpa", OSDI'22, §4): one-hot choices, node costs, resharding
costs on edges, with the edge products linearized through their marginals (exact for binary
choices, tight LP relaxation), solved by a MIP solver through OR-Tools' pywraplp (HiGHS by default:
it beat CBC and SCIP on every layer we timed; all three give the same optimum), one thread.

Decisions, binary x[v, c], one-hot per v:
- op v: the strategy of each non-view op. Backward ops choose independently of their forward op
  (the joint graph runs op by op; the freedom costs a few dozen rows per layer).
- parameter v: its placement R or S(d), i.e. what each rank stores.
- boundary v (layer units): the placement of the activation stream entering and leaving the layer
  (activation and gradient; one decision per shape that both enters and leaves), in = out since
  the next instance is the same layer: R, P (the residual kept as partial sums) or S(d) (S(seq) is
  sequence parallelism). Other external inputs are R; other outputs leave as R.
View ops get no decision: each is merged into its producer, whose choice fixes the view's placement
(`view_dim_map`); a shard a view cannot carry is all-gathered there, charged once.

Objective, seconds per micro-batch of `batch` samples on one rank (µs inside the solver):
  Σ_v Σ_c unary[v, c]·x[v, c] + Σ_k C_k·w[k]
unary: `op_time_s` with the op's work divided by tp when the strategy splits it (what
`cost_models.compute.unit_time` charges), plus collectives inside the strategy (vocab-parallel
softmax statistics) and the gathers its views force. k: converting a tensor from its producer's
placement p to a placement q a consumer needs, paid once however many consumers need q (the result
is reused, as Megatron's propagation assumes; to R or P keyed by the tensor, to a shard by the view
read). C_k (`UnitProblem.reshard`, `collective_time_s` on the tp group): R→S, R→P free; S→R, S→P
all-gather; P→R all-reduce; P→S reduce-scatter; S(a)→S(b) all-to-all of the per-rank block (the
profiler's convention). Bytes: the whole tensor per micro-batch (activations scale from the traced
batch; parameters and their gradients do not). Edges: every tensor an op reads (through views),
each parameter's gradient into the parameter's placement (a replicated weight whose gradient is
partial pays its all-reduce in backward), each unit output into its boundary placement.

Constraint families, one method each on `UnitIlp`:
- `_one_choice`: Σ_c x[v, c] = 1.
- `_edge_marginals`: per edge u→v, y[e, p, q] ≥ 0 with Σ_q y[e, p, q] = Σ_{c: out_u(c)=p} x[u, c] and
  Σ_p y[e, p, q] = Σ_{c: need_v(c)=q} x[v, c], so y = 1 exactly when the edge carries p→q (a side
  with a single placement makes the indicator linear in the other side's x: no y).
- `_shared_reshards`: w[k] ≥ y[e, p, q] for every edge e whose p→q is conversion k (a k with a
  single edge puts C_k on y directly).
- `_runtime_rules` (with the runtime's `TpRules`): parameter placements the runtime executes only
  (`searcher.intra_op_rules`): x = 0 for a placement not allowed; x[bias, S(0)] = x[weight, S(0)];
  per block, x[input, S(0)] = x[output, S(1)] for all its Linear weights (all sharded or all R).
- `_memory_budget` (with a budget): parameter bytes per rank (× `param_state_multiplier`) + saved
  activation bytes per rank (each op's, at autocast's dtypes with `autocast_saved`; × `activation_multiplier`)
  ≤ budget.
The plan is written back as OpFacts (tp_sharded; reduce_bytes: the first all-reduce before an op;
collectives: the others, bytes per sample), so `unit_time` + `evaluate` cost it to `objective_s`.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from autopar.capabilities import TpRules
from autopar.cluster import ClusterSpec
from autopar.graph.ir import OpGraph, OpNode, TensorMeta
from autopar.cost_models.communication import collective_time_s, group_layout
from autopar.cost_models.compute import DEFAULT_EFFICIENCY, Efficiency, op_time_s, unit_fixed_overhead_s
from autopar.cost_models.facts import OpFacts, Unit
from autopar.searcher.intra_op_rules import equal, forbidden
from autopar.searcher.intra_op_strategies import (P, R, S, gradient_tensors, input_names, op_strategies, shard_dim, shardable,
                                          through_views, trace_views)

_US = 1e6  # the solver works in µs


@dataclass(frozen=True)
class LayerSharding:
    ops: tuple[OpFacts, ...]  # unit.ops in the same order, rewritten for the chosen plan
    unit: Unit  # the unit with those ops and its sharded parameter count
    op_placements: dict[str, str]  # node → placement of its (first) output over tp, views included
    op_strategies: dict[str, str]  # non-view node → "strategy[inputs->outputs]"
    param_placements: dict[str, str]
    boundary_placements: dict[str, str]  # stream shape → placement (layer units)
    objective_s: float
    memory_bytes: float  # what the memory row counts, per rank: parameters' part + activations' part
    parameter_bytes: float  # the parameters' part
    variables: int
    constraints: int
    solve_s: float
    status: str  # optimal | feasible (time limit hit) | infeasible | trivial (tp = 1)


@dataclass
class _Decision:
    key: str  # node name, "param:NAME" or "boundary:SHAPE"
    labels: list[str]
    outputs: list[tuple[str, ...]]  # per choice: placement of each output
    unary: list[float]
    memory: list[float]
    breaks: list[dict[str, float]] = field(default_factory=list)  # per choice: view → bytes gathered


@dataclass
class _Edge:
    tensor: tuple  # what is resharded: (root node, output index, reader if ambiguous, last view read)
    src: int
    src_place: list[str]  # per src choice: the tensor's placement where it is read
    dst: int  # -1: a fixed requirement dst_need[0]
    dst_need: list[str | None]  # per dst choice (None: anything)
    nbytes: float
    attach: str  # the op whose OpFacts carries the collective


GraphIndex = tuple[dict[str, OpNode], dict[str, Any], dict[str, list[OpNode]]]
_GRAPH_INDEXES: dict[int, tuple[weakref.ref, list, int, GraphIndex]] = {}  # id(graph) -> (graph, nodes, count, index)


def _graph_index(graph: OpGraph) -> GraphIndex:
    """(node by name, parameter by name, the nodes reading each tensor) of `graph`, built once per graph:
    every unit's problem reads the whole graph's (11,000 nodes for GPT-3 175B, six solves a search).
    Kept while the graph lives and holds the same nodes list, as long as before."""
    entry = _GRAPH_INDEXES.get(id(graph))
    if entry is not None and entry[0]() is graph and entry[1] is graph.nodes and entry[2] == len(graph.nodes):
        return entry[3]
    consumers: dict[str, list[OpNode]] = {}
    for node in graph.nodes:
        for name in dict.fromkeys(input_names(node)):
            consumers.setdefault(name, []).append(node)
    index = ({n.name: n for n in graph.nodes}, {p.name: p for p in graph.params}, consumers)
    key = id(graph)
    _GRAPH_INDEXES[key] = (weakref.ref(graph, lambda _gone: _GRAPH_INDEXES.pop(key, None)), graph.nodes,
                           len(graph.nodes), index)
    return index


class UnitProblem:
    """Decisions, costs and resharding edges of one unit, views merged into their producers.
    `cost(choice)` is the objective the ILP minimizes (tests enumerate it by brute force)."""

    def __init__(self, unit: Unit, graph: OpGraph, tp: int, batch: int, cluster: ClusterSpec, dtype: str,
                 efficiency: Efficiency = DEFAULT_EFFICIENCY, param_state_multiplier: float = 1.0,
                 activation_multiplier: float = 1.0, autocast_saved: bool = False) -> None:
        self.unit, self.tp, self.batch, self.cluster = unit, tp, batch, cluster
        self.efficiency = efficiency
        self.activation_multiplier = activation_multiplier
        self.autocast_saved = autocast_saved
        self.layout = group_layout(tp, 1, cluster.gpus_per_node)
        self.by_name, self.params, self.consumers = _graph_index(graph)  # read only
        self.in_unit = {op.name for op in unit.ops}
        self.scale = batch / max(graph.batch, 1)  # activation bytes: traced batch → this batch
        self.multiplier = param_state_multiplier
        self.decisions: list[_Decision] = []
        self.index: dict[str, int] = {}
        self.edges: list[_Edge] = []
        self.strategies = {}
        self._times: dict[tuple[str, float], float] = {}
        nodes = [self.by_name[op.name] for op in unit.ops]
        for op, node in zip(unit.ops, nodes):
            if not node.is_view:
                self._op(op, node, dtype, efficiency)
        self.gradients = gradient_tensors(nodes, self.consumers, self.params)
        self.fixed = {trace_views(node.name, node.output_meta[k], self.by_name, self.in_unit, k)[0]
                      for node, k in self.gradients.values()}
        self.boundary = self._boundary(nodes) if unit.layer_type is not None else {}
        for node in nodes:
            if not node.is_view:
                for k, (name, meta) in enumerate(zip(input_names(node), node.input_meta)):
                    need = [s.inputs[k] for s in self.strategies[node.name]]
                    self._connect(name, meta, need, self.index[node.name], node.name)
            for meta in self._leaving(node):
                if any(g is node and g.output_meta[k] == meta for g, k in self.gradients.values()):
                    continue  # a gradient leaves in its parameter's placement (edge below)
                target = self.boundary.get(meta.shape, -1)
                need = self.decisions[target].labels if target >= 0 else [R]
                self._connect(node.name, meta, need, target, node.name)
        for pname, (node, k) in self.gradients.items():
            if f"param:{pname}" in self.index:
                target = self.index[f"param:{pname}"]
                self._connect(node.name, node.output_meta[k], self.decisions[target].labels, target, node.name, k)
        for d in self.decisions:
            for choice, views in enumerate(d.breaks):
                d.unary[choice] += sum(self.time("all_gather", b) for b in views.values())

    # --- decisions -------------------------------------------------------------------------------
    def _add(self, key: str, labels, outputs, unary, memory) -> int:
        self.index[key] = len(self.decisions)
        self.decisions.append(_Decision(key, list(labels), list(outputs), list(unary), list(memory),
                                        [{} for _ in labels]))
        return self.index[key]

    def _op(self, op: OpFacts, node: OpNode, dtype: str, efficiency: Efficiency) -> None:
        options = self.strategies[node.name] = op_strategies(node, self.tp)
        times = [op_time_s(dataclasses.replace(op, tp_sharded=divided), self.cluster.gpu, dtype, batch=self.batch,
                           tp=self.tp, sp=False, efficiency=efficiency) for divided in (False, True)]
        kept = op.autocast_saved_bytes if self.autocast_saved and op.autocast_saved_bytes is not None else op.saved_bytes
        saved = kept * self.batch * self.activation_multiplier if op.phase == "forward" else 0.0
        sharded = [bool(s.outputs) and shard_dim(s.outputs[0]) is not None for s in options]
        inside = [sum(self.time(kind, b * self.scale) for kind, b in s.collectives) for s in options]
        self._add(node.name, [s.describe() for s in options], [s.outputs for s in options],
                  [times[s.divided] + extra for s, extra in zip(options, inside)],
                  [saved / (self.tp if x else 1) for x in sharded])

    def _placements(self, shape: tuple[int, ...]) -> list[str]:
        return [R] + [S(d) for d, size in enumerate(shape) if shardable(size, self.tp)]

    def _param(self, name: str) -> int:
        key = f"param:{name}"
        if key not in self.index:
            info = self.params[name]
            nbytes = TensorMeta(shape=info.shape, dtype=info.dtype).bytes * self.multiplier
            labels = self._placements(info.shape)
            self._add(key, labels, [(p,) for p in labels], [0.0] * len(labels),
                      [nbytes / (1 if p == R else self.tp) for p in labels])
        return self.index[key]

    def _boundary(self, nodes: list[OpNode]) -> dict[tuple[int, ...], int]:
        entering = {m.shape for node in nodes for n, m in zip(input_names(node), node.input_meta)
                    if n not in self.in_unit and not n.startswith("param:")}
        leaving = {m.shape for node in nodes for m in self._leaving(node)}
        result = {}
        for shape in sorted(entering & leaving):
            labels = [R, P] + self._placements(shape)[1:]
            result[shape] = self._add(f"boundary:{shape}", labels, [(p,) for p in labels], [0.0] * len(labels),
                                      [0.0] * len(labels))
        return result

    def _leaving(self, node: OpNode) -> list[TensorMeta]:
        """The tensors of `node` that ops outside the unit read."""
        outside = [c for c in self.consumers.get(node.name, []) if c.name not in self.in_unit]
        return list(dict.fromkeys(m for c in outside for n, m in zip(input_names(c), c.input_meta) if n == node.name))

    # --- edges -----------------------------------------------------------------------------------
    def _source(self, name: str, meta: TensorMeta, index: int | None = None):
        """(decision or None for a replicated external, its output index, views, bytes scale, root)."""
        root, chain = trace_views(name, meta, self.by_name, self.in_unit, index)
        if root[0].startswith("param:") and root[0][6:] in self.params:
            return self._param(root[0][6:]), 0, chain, 1.0, root
        scale = 1.0 if root in self.fixed else self.scale
        if root[0] in self.index:
            return self.index[root[0]], root[1], chain, scale, root
        entering = chain[0][1] if chain else meta
        return self.boundary.get(entering.shape), 0, chain, scale, root

    def _connect(self, name: str, meta: TensorMeta, need: list[str | None], dst: int, attach: str,
                 index: int | None = None) -> None:
        src, index, chain, scale, root = self._source(name, meta, index)
        if src is None or src == dst:
            return
        d = self.decisions[src]
        seen = [through_views(out[index] if index < len(out) else R, chain, self.tp, scale, d.breaks[c])
                for c, out in enumerate(d.outputs)]
        outputs = self.by_name[root[0]].output_meta if root[0] in self.by_name else []
        shape = chain[0][1].shape if chain else meta.shape
        ambiguous = sum(m.shape == shape for m in outputs) > 1  # which output is read is unknown:
        reader = (chain[0][0].name if chain else attach) if ambiguous else None  # don't share across readers
        tensor = (*root, reader, chain[-1][0].name if chain else None)
        self.edges.append(_Edge(tensor, src, seen, dst, need, meta.bytes * scale, attach))

    def placement_of(self, name: str, meta: TensorMeta, choice: list[int]) -> str:
        src, index, chain, scale, _ = self._source(name, meta)
        if src is None:
            return R
        out = self.decisions[src].outputs[choice[src]]
        return through_views(out[index] if index < len(out) else R, chain, self.tp, scale, {})

    # --- costs -----------------------------------------------------------------------------------
    def time(self, kind: str, nbytes: float) -> float:
        if (kind, nbytes) not in self._times:
            self._times[kind, nbytes] = collective_time_s(kind, nbytes, self.layout, self.cluster) if nbytes else 0.0
        return self._times[kind, nbytes]

    def reshard(self, have: str, need: str | None, nbytes: float) -> list[tuple[str, float]]:
        if need is None or have == need or have == R or not nbytes:
            return []
        if have == P:
            return [("all_reduce" if need == R else "reduce_scatter", nbytes)]
        return [("all_gather", nbytes)] if need in (R, P) else [("all_to_all", nbytes / self.tp)]

    def reshard_s(self, have: str, need: str | None, nbytes: float) -> float:
        return sum(self.time(kind, b) for kind, b in self.reshard(have, need, nbytes))

    def need(self, edge: _Edge, choice: list[int]) -> str | None:
        return edge.dst_need[0] if edge.dst < 0 else edge.dst_need[choice[edge.dst]]

    def conversion(self, edge: _Edge, have: str, need: str | None) -> tuple:
        """What a conversion is keyed by, so each is paid once however many consumers need it:
        the tensor (to R or P: whichever view reads it) or the view read (to a shard)."""
        root, index, reader, view = edge.tensor
        if need in (R, P):
            return root, index, reader, edge.nbytes, "S" if shard_dim(have) is not None else have, need
        return root, index, reader, edge.nbytes, view, have, need

    def moves(self, choice: list[int]) -> list[tuple[str, str, float]]:
        """(op charged, collective, bytes) of an assignment, each conversion once."""
        result, done = [], set()
        for edge in self.edges:
            have, need = edge.src_place[choice[edge.src]], self.need(edge, choice)
            key = self.conversion(edge, have, need)
            if key not in done:
                done.add(key)
                result += [(edge.attach, kind, b) for kind, b in self.reshard(have, need, edge.nbytes)]
        return result

    def cost(self, choice: list[int]) -> float:
        """The objective of a full assignment (what brute force enumerates and the ILP minimizes)."""
        unary = sum(d.unary[c] for d, c in zip(self.decisions, choice))  # views' gathers included
        return unary + sum(self.time(kind, b) for _, kind, b in self.moves(choice))

    def memory(self, choice: list[int], parameters_only: bool = False) -> float:
        return sum(d.memory[c] for d, c in zip(self.decisions, choice)
                   if not parameters_only or d.key.startswith("param:"))


class UnitIlp:
    """The MIP over a `UnitProblem`: binary x per choice; continuous y per edge pair, w per shared conversion."""

    def __init__(self, problem: UnitProblem, memory_budget_bytes: float | None, solver_name: str = "HIGHS",
                 tp_rules: TpRules | None = None) -> None:
        from ortools.linear_solver import pywraplp

        self.problem = problem
        self.solver = pywraplp.Solver.CreateSolver(solver_name)
        if self.solver is None:
            raise RuntimeError(f"OR-Tools offers no {solver_name} solver here")
        self.solver.SetNumThreads(1)  # one thread: the same answer every time
        if solver_name == "HIGHS":
            self.solver.SetSolverSpecificParametersAsString("output_flag=false")  # no banner on stdout
        self.terms: dict = {}
        self.x = [[self.solver.BoolVar(f"x{v}_{c}") for c in range(len(d.labels))] if len(d.labels) > 1 else None
                  for v, d in enumerate(problem.decisions)]
        for v, d in enumerate(problem.decisions):
            for c, cost in enumerate(d.unary):
                self._term(v, [c], cost * _US)
        self._one_choice()
        self._shared_reshards(self._edge_marginals())
        if tp_rules is not None:
            self._runtime_rules(tp_rules)
        if memory_budget_bytes is not None:
            self._memory_budget(memory_budget_bytes)
        objective = self.solver.Objective()
        for var, coefficient in self.terms.items():
            objective.SetCoefficient(var, coefficient)
        objective.SetMinimization()

    def _term(self, v: int, choices: list[int], coefficient: float) -> None:
        if self.x[v] is not None and coefficient:
            for c in choices:
                self.terms[self.x[v][c]] = self.terms.get(self.x[v][c], 0.0) + coefficient

    def _row(self, items: list[tuple[int, list[int], float]], extra: list[tuple], lower: float, upper: float):
        """lower ≤ Σ sign·Σ_c x[v, c] + Σ coef·var ≤ upper, single-choice decisions moved to the bounds."""
        constant, coefficients = 0.0, {}
        for v, choices, sign in items:
            if self.x[v] is None:
                constant += sign * len(choices)
            else:
                for c in choices:
                    coefficients[self.x[v][c]] = coefficients.get(self.x[v][c], 0.0) + sign
        row = self.solver.Constraint(lower - constant, upper - constant)
        for var, coefficient in [*coefficients.items(), *extra]:
            row.SetCoefficient(var, coefficient)

    @staticmethod
    def _classes(edge: _Edge) -> tuple[dict, dict]:
        """Producer choices grouped by the placement they deliver; consumer choices by need."""
        have: dict[str, list[int]] = {}
        need: dict[str | None, list[int]] = {}
        for groups, values in ((have, edge.src_place), (need, edge.dst_need if edge.dst >= 0 else edge.dst_need[:1])):
            for c, value in enumerate(values):
                groups.setdefault(value, []).append(c)
        return have, need

    def _one_choice(self) -> None:
        for v, xs in enumerate(self.x):
            if xs is not None:
                self._row([(v, list(range(len(xs))), 1.0)], [], 1.0, 1.0)

    def _pairs(self, edge: _Edge) -> dict[tuple, tuple[list, list]]:
        """Per (have p, need q): the indicator that the edge carries p→q, as (x items, y terms)."""
        have, need = self._classes(edge)
        if len(need) == 1:
            q = next(iter(need))
            return {(p, q): ([(edge.src, choices, 1.0)], []) for p, choices in have.items()}
        if len(have) == 1:
            p = next(iter(have))
            return {(p, q): ([(edge.dst, choices, 1.0)], []) for q, choices in need.items()}
        y = {(p, q): self.solver.NumVar(0, 1, "") for p in have for q in need}
        for p, choices in have.items():
            self._row([(edge.src, choices, -1.0)], [(y[p, q], 1.0) for q in need], 0.0, 0.0)
        for q, choices in need.items():
            self._row([(edge.dst, choices, -1.0)], [(y[p, q], 1.0) for p in have], 0.0, 0.0)
        return {pair: ([], [(var, 1.0)]) for pair, var in y.items()}

    def _cost(self, edge: _Edge) -> dict[tuple, float]:
        have, need = self._classes(edge)
        return {(p, q): self.problem.reshard_s(p, q, edge.nbytes) * _US for p in have for q in need}

    def _edge_marginals(self) -> dict[tuple, list]:
        """Per costly conversion: the indicators (x items, y terms) of the edges that need it."""
        needed: dict[tuple, list] = {}
        for edge in self.problem.edges:
            cost = self._cost(edge)
            if any(cost.values()):
                for pair, indicator in self._pairs(edge).items():
                    if cost[pair]:
                        needed.setdefault((self.problem.conversion(edge, *pair), cost[pair]), []).append(indicator)
        return needed

    def _shared_reshards(self, needed: dict[tuple, list]) -> None:
        for (_, cost), indicators in needed.items():
            if len(indicators) == 1:  # one reader: pay on its indicator directly
                items, extra = indicators[0]
                for v, choices, _ in items:
                    self._term(v, choices, cost)
                for var, _ in extra:
                    self.terms[var] = self.terms.get(var, 0.0) + cost
                continue
            paid = self.solver.NumVar(0, 1, "")  # ≥ every reader's indicator: paid once if any
            self.terms[paid] = cost
            for items, extra in indicators:
                row_vars = [(paid, 1.0)] + [(var, -sign) for var, sign in extra]
                self._row([(v, c, -sign) for v, c, sign in items], row_vars, 0.0, self.solver.infinity())

    def _runtime_rules(self, rules: TpRules) -> None:
        """Only parameter placements the runtime executes: a solution it refuses is no proposal."""
        labels = {d.key[6:]: d.labels for d in self.problem.decisions if d.key.startswith("param:")}

        def item(indicator: tuple[str, str], sign: float) -> tuple[int, list[int], float]:
            v = self.problem.index[f"param:{indicator[0]}"]
            return v, [c for c, label in enumerate(labels[indicator[0]]) if label == indicator[1]], sign

        for indicator in forbidden(rules, labels):
            v, choices, _ = item(indicator, 1.0)
            for c in choices if self.x[v] is not None else ():  # a single choice is R: always allowed
                self.x[v][c].SetUb(0.0)
        for a, b in equal(rules, labels):
            self._row([item(a, 1.0), item(b, -1.0)], [], 0.0, 0.0)

    def _memory_budget(self, budget: float) -> None:
        items = [(v, [c], nbytes / 2**20) for v, d in enumerate(self.problem.decisions)
                 for c, nbytes in enumerate(d.memory) if nbytes]  # MiB keeps the row well scaled
        self._row(items, [], -self.solver.infinity(), budget / 2**20)

    def solve(self, time_limit_s: float) -> tuple[str, list[int] | None]:
        from ortools.linear_solver import pywraplp

        self.solver.SetTimeLimit(int(time_limit_s * 1000))
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, 1e-9)
        status = self.solver.Solve(params)
        if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            return ("infeasible" if status == pywraplp.Solver.INFEASIBLE else "not solved"), None
        choice = [0 if xs is None else max(range(len(xs)), key=lambda c: (xs[c].solution_value(), -c))
                  for xs in self.x]
        return ("optimal" if status == pywraplp.Solver.OPTIMAL else "feasible"), choice


def solve_unit(unit: Unit, graph: OpGraph, *, tp: int, batch: int, cluster: ClusterSpec, dtype: str,
               memory_budget_bytes: float | None = None, efficiency: Efficiency = DEFAULT_EFFICIENCY,
               time_limit_s: float = 30.0, param_state_multiplier: float = 1.0, solver: str = "HIGHS",
               tp_rules: TpRules | None = None, activation_multiplier: float = 1.0,
               autocast_saved: bool = False) -> LayerSharding:
    """The cheapest tp sharding of one unit (module docstring). `param_state_multiplier` scales
    parameter bytes in the memory row (e.g. weight + gradient + optimizer bytes per weight byte),
    `activation_multiplier` saved activation bytes (e.g. micro-batches held in flight); `autocast_saved`:
    each op's saved bytes at autocast's dtypes (`OpFacts.autocast_saved_bytes`) rather than the trace's.
    `tp_rules` (the runtime's, looked up by this unit's parameter names) keeps the parameter
    placements to those the runtime executes.
    An unmet budget gives status "infeasible", objective inf and the unit unchanged."""
    started = time.perf_counter()
    if tp <= 1:
        total = sum(op_time_s(op, cluster.gpu, dtype, batch=batch, tp=1, sp=False, efficiency=efficiency)
                    for op in unit.ops) + unit_fixed_overhead_s(unit, efficiency)
        return LayerSharding(unit.ops, unit, {op.name: R for op in unit.ops}, {}, {}, {}, total, 0.0, 0.0, 0, 0,
                             time.perf_counter() - started, "trivial")
    problem = UnitProblem(unit, graph, tp, batch, cluster, dtype, efficiency, param_state_multiplier,
                          activation_multiplier, autocast_saved)
    ilp = UnitIlp(problem, memory_budget_bytes, solver, tp_rules)
    status, choice = ilp.solve(time_limit_s)
    size = (ilp.solver.NumVariables(), ilp.solver.NumConstraints())
    if choice is None:
        return LayerSharding(unit.ops, unit, {}, {}, {}, {}, float("inf"), float("inf"), float("inf"), *size,
                             time.perf_counter() - started, status)
    return _result(problem, choice, status, size, time.perf_counter() - started)


def _result(problem: UnitProblem, choice: list[int], status: str, size: tuple, solve_s: float) -> LayerSharding:
    """The chosen plan as OpFacts the cost models read, and as placements."""
    charges: dict[str, list[tuple[str, float]]] = {}
    for d, c in zip(problem.decisions, choice):
        for view, nbytes in d.breaks[c].items():
            charges.setdefault(view, []).append(("all_gather", nbytes))
    for name, options in problem.strategies.items():
        for kind, nbytes in options[choice[problem.index[name]]].collectives:
            charges.setdefault(name, []).append((kind, nbytes * problem.scale))
    for attach, kind, nbytes in problem.moves(choice):
        charges.setdefault(attach, []).append((kind, nbytes))
    batch = problem.batch
    ops, op_placements, op_strategies = [], {}, {}
    for op in problem.unit.ops:
        node = problem.by_name[op.name]
        moves = charges.get(op.name, [])
        reduces = [b for kind, b in moves if kind == "all_reduce"]
        others = [(k, b) for k, b in moves if k != "all_reduce"] + [("all_reduce", b) for b in reduces[1:]]
        changes = dict(reduce_bytes=reduces[0] / batch if reduces else 0.0,
                       collectives=tuple((k, b / batch) for k, b in others), tp_sharded=False)
        if node.is_view:
            op_placements[op.name] = problem.placement_of(op.name, node.output_meta[0], choice) \
                if node.output_meta else R
        else:
            strategy = problem.strategies[op.name][choice[problem.index[op.name]]]
            changes["tp_sharded"] = strategy.divided
            changes["saved_sharded"] = bool(strategy.outputs) and shard_dim(strategy.outputs[0]) is not None
            op_placements[op.name] = strategy.outputs[0] if strategy.outputs else R
            op_strategies[op.name] = strategy.describe()
        ops.append(dataclasses.replace(op, **changes))
    chosen = {d.key: d.labels[c] for d, c in zip(problem.decisions, choice)}
    params = {k[6:]: v for k, v in chosen.items() if k.startswith("param:")}
    owner: dict[str, str] = {}  # a parameter belongs to the unit that reads it first (as in facts)
    for node in problem.by_name.values():
        owner.update({name: node.name for name in node.params if name not in owner})
    sharded = sum(problem.params[p].numel for p, at in owner.items() if at in problem.in_unit and params.get(p, R) != R)
    unit = dataclasses.replace(problem.unit, ops=tuple(ops), sharded_params=min(sharded, problem.unit.params))
    return LayerSharding(tuple(ops), unit, op_placements, op_strategies, params,
                         {k[9:]: v for k, v in chosen.items() if k.startswith("boundary:")},
                         problem.cost(choice) + unit_fixed_overhead_s(problem.unit, problem.efficiency),
                         problem.memory(choice), problem.memory(choice, parameters_only=True),
                         *size, solve_s, status)
