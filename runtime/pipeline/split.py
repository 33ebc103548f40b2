"""Cut a captured model program (`runtime.model_program`) into pipeline stages.

Each node runs on one stage: a layer's call on the stage the plan gives that layer; the code
between layers on the stage of the cost model's unit it belongs to (the run before the first
layer, between two layers, or after the last), found by position as the cost model found it.
Code that reads no parameter and no layer output (causal masks, position ids, rotary tables
from buffers) is recomputed on every stage that needs it instead of being sent: every stage
gets the model's inputs. What crosses a cut is every other value made before it and read after
it (hidden states, an encoder's output on its way to the decoder, position biases), in program
order; values that only pass through a stage are handed on. The last stage returns the model's
output leaves; leaves made on an earlier stage travel only if the loss reads them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from autopar.errors import AutoparError
from autopar.runtime.model_program import ModelProgram


@dataclasses.dataclass
class StageGraph:
    """One stage's share of the program, as an fx graph with its interface."""

    index: int
    graph: fx.Graph
    received: list[str]  # program values received from the previous stage (positional inputs, in order)
    sent: list[str]  # program values sent to the next stage (outputs, in order); empty on the last stage
    output_slots: list[int]  # last stage: which output leaves it returns (the others are not read by the loss)


@dataclasses.dataclass
class ProgramSplit:
    stages: list[StageGraph]
    stage_of: dict[str, int]  # program node name -> the stage that computes it (recomputed values: absent)
    crossing: list[list[fx.Node]]  # per cut k|k+1: the values sent


def split_program(program: ModelProgram, stage_units: list[list[str]], layer_paths: set[str],
                  parameter_names: set[str], output_reads: set[int] | None = None) -> ProgramSplit:
    """Assign every node of `program` to a stage and build each stage's graph.

    `stage_units`: per stage, the cost model's unit names it holds, in order (layer units are module
    paths, others "pre", "between.N", "post"). `parameter_names`: the model's parameter names (a
    `get_attr` of one is not recomputable). `output_reads`: indices of the output leaves the loss
    reads (None: all).
    """
    nodes = list(program.graph.nodes)
    recomputable = _recomputable(nodes, parameter_names)
    stage_of = _assign_stages(nodes, recomputable, stage_units, layer_paths)
    last = len(stage_units) - 1
    output = nodes[-1]
    leaves = list(output.args[0])
    returned = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node)
                and (output_reads is None or i in output_reads or stage_of.get(leaf.name, last) == last)]
    consumers: dict[str, set[int]] = {}
    for node in nodes:
        if node.op == "output":
            continue
        if node.name in stage_of:
            for used in node.all_input_nodes:
                consumers.setdefault(used.name, set()).add(stage_of[node.name])
    for i in returned:
        consumers.setdefault(leaves[i].name, set()).add(last)
    crossing = []
    for cut in range(last):
        crossing.append([node for node in nodes if node.name in stage_of and stage_of[node.name] <= cut
                         and any(stage > cut for stage in consumers.get(node.name, ()))])
    stages = []
    for index in range(last + 1):
        received = [n.name for n in crossing[index - 1]] if index > 0 else []
        sent = [n.name for n in crossing[index]] if index < last else []
        graph = _stage_graph(program, nodes, index, stage_of, recomputable, received, sent,
                             [leaves[i] for i in returned] if index == last else None)
        stages.append(StageGraph(index, graph, received, sent, returned if index == last else []))
    return ProgramSplit(stages, stage_of, crossing)


def _recomputable(nodes: list[fx.Node], parameter_names: set[str]) -> set[str]:
    """Nodes computed from the model's inputs, buffers and constants only: every stage can make them."""
    result: set[str] = set()
    for node in nodes:
        if node.op == "placeholder":
            result.add(node.name)
        elif node.op == "get_attr":
            if node.target not in parameter_names:
                result.add(node.name)
        elif node.op == "call_function" and all(i.name in result for i in node.all_input_nodes):
            result.add(node.name)
    return result


def _assign_stages(nodes: list[fx.Node], recomputable: set[str], stage_units: list[list[str]],
                   layer_paths: set[str]) -> dict[str, int]:
    """The stage of every node that is not recomputed, as the cost model's units place it."""
    stage_of_unit = {unit: index for index, units in enumerate(stage_units) for unit in units}
    sequence = [unit for units in stage_units for unit in units]
    layers_in_plan = [u for u in sequence if u in layer_paths]
    run_after: dict[str | None, str] = {}  # the layer a run follows (None: no layer yet) -> that run's unit
    previous: str | None = None
    for unit in sequence:
        if unit in layer_paths:
            previous = unit
        else:
            run_after[previous] = unit
    called = [n.target for n in nodes if n.op == "call_module" and n.target in layer_paths]
    if called != layers_in_plan:
        raise AutoparError(f"the plan's layers {layers_in_plan[:3]}... run in another order than the model calls "
                           f"them ({called[:3]}...): re-run `autopar plan` for this model")
    result: dict[str, int] = {}
    previous = None
    for node in nodes:
        if node.op in ("placeholder", "output") or node.name in recomputable:
            continue
        if node.op == "call_module" and node.target in layer_paths:
            previous = node.target
            result[node.name] = stage_of_unit[node.target]
            continue
        unit = run_after.get(previous)
        if unit is not None:
            result[node.name] = stage_of_unit[unit]
        else:  # code the cost model saw no op of (a view): it stays with the layer before it
            result[node.name] = stage_of_unit[previous] if previous is not None else 0
    for node in nodes:
        for used in node.all_input_nodes:
            if node.name in result and used.name in result and result[used.name] > result[node.name]:
                raise AutoparError(f"{node.name} on pipeline stage {result[node.name]} reads {used.name} from the "
                                   f"later stage {result[used.name]}: the plan's stages are out of order")
    return result


def _stage_graph(program: ModelProgram, nodes: list[fx.Node], index: int, stage_of: dict[str, int],
                 recomputable: set[str], received: list[str], sent: list[str],
                 returned: list[fx.Node] | None) -> fx.Graph:
    """Stage `index`: received values positionally, the model's inputs by keyword, its own nodes and
    the recomputed ones they need; out go the values sent on (or the returned leaves)."""
    own = {n.name for n in nodes if stage_of.get(n.name) == index}
    wanted = set(own) | set(sent) | {n.name for n in returned or ()}
    needed: set[str] = set()
    by_name = {n.name: n for n in nodes}
    pending = list(wanted)
    while pending:  # recomputed values the stage's own nodes (transitively) read
        name = pending.pop()
        for used in by_name[name].all_input_nodes:
            if used.name in recomputable and used.name not in needed:
                needed.add(used.name)
                pending.append(used.name)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for position, name in enumerate(received):
        env[name] = graph.placeholder(f"received_{position}")
        env[name].meta = dict(by_name[name].meta)
    for node in nodes:
        if node.op == "placeholder":
            env[node.name] = graph.placeholder(node.name)
            env[node.name].meta = dict(node.meta)
    for node in nodes:
        if node.op in ("placeholder", "output") or node.name in env:
            continue
        if node.name in own or node.name in needed:
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    if returned is not None:
        graph.output(tuple(env[n.name] for n in returned))
    else:
        outputs = []
        for name in sent:
            value = env[name]
            if value.op == "placeholder":  # handed on: a view, so the stage's output is not its input
                value = graph.call_function(torch.ops.aten.alias.default, (value,))
            outputs.append(graph.call_method("contiguous", (value,)))
        graph.output(tuple(outputs))
    return graph
