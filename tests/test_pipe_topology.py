"""DeepSpeed's pipeline topology classes under partita (``deepspeed.runtime.pipe.topology``).

The rank queries are compared with DeepSpeed 0.19.8's own answers, recorded in
``tests/fixtures/ds_topology_answers.json`` by ``tests/fixtures/make_ds_topology_answers.py``
(run under the benchmark environment; DeepSpeed is not a test dependency). PipelineModule is
built with such topologies on 2 and 4 gloo ranks: each rank must build the stage DeepSpeed's
topology assigns it, and topologies that would place ranks differently than partita's mesh are
refused.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from torch import nn

from partita.runtime.pipe import topology as ds_topology
from tests.fixtures.make_ds_topology_answers import SHAPES, answers
from tests.harness import run_distributed

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "ds_topology_answers.json"
RECORDED = json.loads(FIXTURE.read_text())


def test_fixture_covers_the_generator_shapes() -> None:
    assert RECORDED["deepspeed_version"] == "0.19.8"
    assert [[s["label"], s["class"], s["kwargs"]] for s in RECORDED["shapes"]] == [list(s) for s in SHAPES]


@pytest.mark.parametrize("shape", RECORDED["shapes"], ids=[s["label"] for s in RECORDED["shapes"]])
def test_rank_queries_answer_as_deepspeed(shape: dict) -> None:
    topo = getattr(ds_topology, shape["class"])(**shape["kwargs"])
    ours = json.loads(json.dumps(answers(topo)))  # the same JSON round trip the fixture went through
    expected = shape["answers"]
    assert ours.keys() == expected.keys()
    for key in expected:  # one key at a time, so a failure names the query
        assert ours[key] == expected[key], key


def test_coordinates_are_namedtuples_and_mapping_is_public() -> None:
    topo = ds_topology.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    coord = topo.get_coord(5)
    assert (coord.pipe, coord.data, coord.model) == (1, 0, 1)
    assert coord._replace(pipe=0) == topo.ProcessCoord(pipe=0, data=0, model=1)
    assert topo.mapping[coord] == 5 and topo.get_rank(**coord._asdict()) == 5
    assert topo.get_coord(np.int64(5)) == coord and topo.get_coord(torch.tensor(5)) == coord
    axes = ["x", "y"]
    assert ds_topology.ProcessTopology(axes, [2, 3]).get_axis_names() is axes  # DeepSpeed returns the caller's list


def test_bad_queries_and_shapes_raise_value_errors_naming_them() -> None:
    topo = ds_topology.PipeDataParallelTopology(num_pp=2, num_dp=2)
    with pytest.raises(ValueError, match=r"unknown axes \['model'\]; this topology's axes are \['pipe', 'data'\]"):
        topo.get_rank(pipe=0, model=1)
    with pytest.raises(ValueError, match=r"coordinate \{'pipe': 2, 'data': 0\} is outside the grid"):
        topo.get_rank(pipe=2, data=0)
    with pytest.raises(ValueError, match=r"filter_match\(\): unknown axis 'model'"):
        topo.filter_match(model=0)
    with pytest.raises(ValueError, match=r"get_axis_list\(\): unknown axis 'model'"):
        topo.get_axis_list("model", 0)
    with pytest.raises(ValueError, match="rank -1 not found in topology."):
        topo.get_coord(-1)
    with pytest.raises(ValueError, match=r"one size per axis: axes=\['a', 'b'\] has 2, dims=\[2\] has 1"):
        ds_topology.ProcessTopology(["a", "b"], [2])
    with pytest.raises(ValueError, match="axis 'data' has size 0; every size must be an int >= 1"):
        ds_topology.PipeDataParallelTopology(num_pp=2, num_dp=0)
    with pytest.raises(ValueError, match=r"distinct identifiers, got \['a', 'a'\]"):
        ds_topology.ProcessTopology(["a", "a"], [1, 2])


def test_pipeline_parallel_grid_is_refused_naming_the_engine_topology() -> None:
    from partita import MissingDeepSpeedFeature
    from partita.runtime._missing import MissingDeepSpeedImport

    with pytest.raises(MissingDeepSpeedFeature, match=r"PipelineParallelGrid .* use engine.topology"):
        ds_topology.PipelineParallelGrid
    with pytest.raises(MissingDeepSpeedImport, match=r"PipelineParallelGrid .* use engine.topology"):
        from partita.runtime.pipe.topology import PipelineParallelGrid  # noqa: F401


def test_mesh_sizes_maps_axes_and_refuses_other_placements() -> None:
    from partita.pipe.topology import mesh_sizes

    assert mesh_sizes(ds_topology.PipeModelDataParallelTopology(2, 2, 3), 12) == {"pipe": 2, "data": 3, "tensor": 2}
    assert mesh_sizes(ds_topology.PipeDataParallelTopology(4, 1), 4) == {"pipe": 4, "data": 1, "tensor": 1}
    # Size-1 axes never move a rank: data before pipe is partita's layout when data is 1.
    assert mesh_sizes(ds_topology.ProcessTopology(["data", "pipe"], [1, 2]), 2) == {"pipe": 2, "data": 1, "tensor": 1}
    with pytest.raises(ValueError, match=r"the axis order \['data', 'pipe'\] puts rank 1 at \(data=0, pipe=1\) but "
                                         r"partita's mesh .* puts it at \(data=1, pipe=0\); build it as "
                                         r"PipeModelDataParallelTopology"):
        mesh_sizes(ds_topology.ProcessTopology(["data", "pipe"], [2, 2]), 4)
    with pytest.raises(ValueError, match=r"axis order \['pipe', 'model', 'data'\] puts rank 1"):
        mesh_sizes(ds_topology.ProcessTopology(["pipe", "model", "data"], [1, 2, 2]), 4)
    with pytest.raises(ValueError, match=r"sizes pipe=2 x data=2 = 4 ranks, but the job has 2"):
        mesh_sizes(ds_topology.PipeDataParallelTopology(2, 2), 2)
    with pytest.raises(ValueError, match=r"axes \['expert'\] have no partita counterpart"):
        mesh_sizes(ds_topology.ProcessTopology(["pipe", "expert"], [2, 1]), 2)
    with pytest.raises(ValueError, match=r"has no 'pipe' axis \(axes \['data'\]\)"):
        mesh_sizes(ds_topology.ProcessTopology(["data"], [2]), 2)


# ---------------------------------------------------------------------- PipelineModule on gloo ranks
def _layers() -> list:
    from partita.pipe import LayerSpec

    return [LayerSpec(nn.Linear, 4, 4) for _ in range(4)]


def _stage_record(module, topo) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    return {"rank": rank, "stage": module.stage_id, "num_stages": module.num_stages,
            "expected_stage": topo.get_coord(rank).pipe, "layers": sorted(int(k) for k in module._modules if k.isdigit()),
            "sizes": module.topology_sizes}


BASE_SEED = 77


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(4, 4, generator=generator), torch.randn(4, 4, generator=generator)


def _reference() -> tuple[float, dict]:
    """The same four seeded layers in one process: the batch's loss and the weights after one SGD step."""
    layers = []
    for i in range(4):
        torch.manual_seed(BASE_SEED + i)  # seed_layers: layer i is built under base_seed + i
        layers.append(nn.Linear(4, 4))
    model = nn.Sequential(*layers)
    x, y = _batch()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return loss.item(), {k: v.tolist() for k, v in model.state_dict().items()}


def two_rank_body() -> list:
    import partita
    from partita.pipe import PipelineModule

    partita.init_distributed()
    torch.manual_seed(0)
    records = []
    for topo in (ds_topology.PipeDataParallelTopology(num_pp=2, num_dp=1),
                 ds_topology.PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1),
                 ds_topology.ProcessTopology(["data", "pipe"], [1, 2])):
        records.append(_stage_record(PipelineModule(layers=_layers(), topology=topo, partition_method="uniform"), topo))
    # initialize() with a topology that matches the config's mesh, then one whose model axis does not.
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000}
    topo = ds_topology.PipeDataParallelTopology(num_pp=2, num_dp=1)
    module = PipelineModule(layers=_layers(), topology=topo, loss_fn=nn.functional.mse_loss, partition_method="uniform",
                            seed_layers=True, base_seed=BASE_SEED)
    engine, *_ = partita.initialize(model=module, config=config)
    mesh = engine.topology
    x, y = _batch()
    loss = engine.train_batch(iter([(x[:2], y[:2]), (x[2:], y[2:])]))
    weights = {k: v.tolist() for k, v in engine.module.state_dict().items()}
    records.append({"engine_mesh": [mesh.pipe_rank, mesh.pipe_size, mesh.data_size, mesh.tensor_size],
                    "expected_pipe": topo.get_coord(mesh.rank).pipe, "loss": float(loss), "weights": weights})
    wide = PipelineModule(layers=_layers(), topology=ds_topology.PipeModelDataParallelTopology(1, 2, 1),
                          loss_fn=nn.functional.mse_loss)
    try:
        partita.initialize(model=wide, config=config)
        mismatch = None
    except ValueError as error:
        mismatch = [type(error).__name__, str(error)]
    errors = []
    for topo, kwargs in ((ds_topology.PipeDataParallelTopology(num_pp=1, num_dp=1), {}),
                         (ds_topology.PipeDataParallelTopology(num_pp=2, num_dp=1), {"num_stages": 1})):
        try:
            PipelineModule(layers=_layers(), topology=topo, **kwargs)
        except ValueError as error:
            errors.append(str(error))
    return [records, errors, mismatch]


def test_pipeline_module_takes_deepspeed_topologies_on_two_ranks() -> None:
    results = run_distributed(two_rank_body, 2)
    for rank, (records, errors, mismatch) in enumerate(results):
        engine = records.pop()
        assert engine["engine_mesh"] == [rank, 2, 1, 1] and engine["expected_pipe"] == rank
        ref_loss, ref_weights = _reference()
        assert engine["loss"] == pytest.approx(ref_loss, abs=1e-6)
        mine = {k: v for k, v in ref_weights.items() if int(k.split(".")[0]) in ((0, 1) if rank == 0 else (2, 3))}
        assert engine["weights"].keys() == mine.keys()
        for key, value in mine.items():
            assert torch.allclose(torch.tensor(engine["weights"][key]), torch.tensor(value), atol=1e-6), key
        assert mismatch == [
            "ConfigError",
            "the PipelineModule's topology (pipe=1, data=1, model=2) disagrees with the mesh the config builds (pipe=1, "
            "data=2, model=1; model is tensor_parallel.autotp_size, data is what pipe x tensor leave): set "
            "\"tensor_parallel\": {\"autotp_size\": 2} (or build the topology with num_mp=1)",
        ]
        for record in records:
            assert record["rank"] == rank
            assert record["stage"] == record["expected_stage"] == rank
            assert record["num_stages"] == 2
            assert record["layers"] == ([0, 1] if rank == 0 else [2, 3])
            assert record["sizes"] == {"pipe": 2, "data": 1, "tensor": 1}
        assert errors == [
            "PipelineModule(topology=...): the topology's sizes pipe=1 x data=1 = 1 ranks, but the job has 2: size "
            "the topology for 2 processes or launch 1",
            "num_stages=1 disagrees with the topology's pipe size 2; give one",
        ]


def four_rank_body() -> list:
    import partita
    from partita.pipe import PipelineModule

    partita.init_distributed()
    records = []
    for topo in (ds_topology.PipeDataParallelTopology(num_pp=2, num_dp=2),
                 ds_topology.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1),
                 ds_topology.PipeModelDataParallelTopology(num_pp=4, num_mp=1, num_dp=1)):
        records.append(_stage_record(PipelineModule(layers=_layers(), topology=topo, partition_method="uniform"), topo))
    try:
        PipelineModule(layers=_layers(), topology=ds_topology.ProcessTopology(["data", "pipe"], [2, 2]))
        refused = None
    except ValueError as error:
        refused = str(error)
    return [records, refused]


def test_pipeline_module_takes_deepspeed_topologies_on_four_ranks() -> None:
    results = run_distributed(four_rank_body, 4)
    for rank, (records, refused) in enumerate(results):
        pipe2_data2, pipe2_model2, pipe4 = records
        for record in records:
            assert record["stage"] == record["expected_stage"]
        assert pipe2_data2["stage"] == rank // 2 and pipe2_data2["sizes"] == {"pipe": 2, "data": 2, "tensor": 1}
        assert pipe2_data2["layers"] == ([0, 1] if rank < 2 else [2, 3])
        assert pipe2_model2["stage"] == rank // 2 and pipe2_model2["sizes"] == {"pipe": 2, "data": 1, "tensor": 2}
        assert pipe4["stage"] == rank and pipe4["layers"] == [rank] and pipe4["num_stages"] == 4
        assert refused == (
            "PipelineModule(topology=...): the axis order ['data', 'pipe'] puts rank 1 at (data=0, pipe=1) but "
            "partita's mesh (pipe, data, tensor from outermost to innermost) puts it at (data=1, pipe=0); build it as "
            "PipeModelDataParallelTopology(num_pp, num_mp, num_dp) (axes ['pipe', 'data', 'model']) or "
            "PipeDataParallelTopology(num_pp, num_dp), or pass num_stages=<int> instead of a topology"
        )
