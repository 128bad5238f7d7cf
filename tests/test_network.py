"""The network as it is (jaxpar/lab/network.py): collectives placed on NVLink domains and
priced hierarchically where their group crosses them; the profiles' network fields."""

from __future__ import annotations

import math
from dataclasses import astuple, replace

import pytest
import yaml

from jaxpar.config import apply_overrides, load_config
from jaxpar.errors import ConfigError
from jaxpar.lab import analytic, hardware, measure, predict, sweep
from jaxpar.lab.network import Placement, placements, step_time
from jaxpar.lab.plan_text import format_plan
from jaxpar.lab.terms import Term
from jaxpar.mesh import grid_ranks
from jaxpar.run import build
from tests.helpers import GPT_SMALL
from tests.test_moe import MOE

GB = 1e9


def _mesh(**degrees: int) -> dict[str, int]:
    """Mesh sizes in mesh order (data, stage, fsdp, context, tensor), unnamed axes 1."""
    return {a: degrees.get(a, 1) for a in ("data", "stage", "fsdp", "context", "tensor")}


@pytest.fixture(scope="module")
def h100():
    """The H100 profile at its wire's rates (NVLink 450 GB/s, the NIC 50 GB/s): the share
    of them NCCL reaches has its own test."""
    return replace(hardware.get_profile("h100"), link_efficiency=1.0, network_efficiency=1.0)


def test_inside_one_domain_it_is_the_roofline(h100):
    """Every group inside the 8-GPU domain: the roofline of the same bytes and count,
    hidden terms apart, ``scale`` on every term's bytes, ``calls`` for the count."""
    terms = [
        Term("all-reduce", "a", 3 * GB, 2, 4, axes=("data",)),
        Term("all-gather", "b", 1 * GB, 4, 2, axes=("data", "fsdp")),
        Term("reduce-scatter", "c", 2 * GB, 2, 1, axes=("fsdp",)),
        Term("all-to-all", "d", 0.5 * GB, 2, 3, axes=("tensor",)),
        Term("collective-permute", "e", 0.25 * GB, 2, 5, hidden=True, axes=("tensor",)),
        Term("all-reduce", "unknown axes", 1 * GB, 4, 1),
    ]
    sizes = _mesh(data=2, fsdp=2, tensor=2)
    for calls, scale in ((None, 1.0), (7, 1.5)):
        got = step_time(h100, 1e12, 1e10, terms, sizes, "bfloat16", calls=calls, scale=scale)
        exposed = scale * sum(t.wire_bytes for t in terms if not t.hidden)
        count = sum(t.times for t in terms if not t.hidden) if calls is None else calls
        hidden = scale * terms[4].wire_bytes
        want = hardware.roofline(h100, 1e12, 1e10, exposed, "bfloat16", count, hidden)
        assert astuple(got) == pytest.approx(astuple(want), rel=1e-12)
        assert got.comm_s == pytest.approx(exposed / 450e9, rel=1e-12)
    # a profile without domain_devices: one domain of any size, as before
    flat = replace(h100, domain_devices=0)
    whole = replace(terms[0], group=64)
    wide = step_time(flat, 0, 0, [whole], _mesh(data=64, tensor=16), "bfloat16")
    assert wide.comm_s == pytest.approx(4 * 3 * GB * 2 * 63 / 64 / 450e9, rel=1e-12)


def test_an_all_reduce_over_two_nodes_of_eight_is_hierarchical(h100):
    """16 GPUs = 2 HGX nodes: reduce-scatter over NVLink inside each node (7/8 of 1 GB), an
    all-reduce of the 1/8 shard across the 2 nodes over each GPU's 50 GB/s NIC (2·1/2 of
    1/8 GB), all-gather inside (7/8 GB again); α: NCCL's 10 µs plus 10 µs for the one
    level of its tree across nodes."""
    sizes = _mesh(data=2, tensor=8)
    assert placements(("data", "tensor"), sizes, 8) == {Placement(members=8, domains=2)}
    term = Term("all-reduce", "gradients", 1 * GB, 16, axes=("data", "tensor"))
    got = step_time(h100, 0, 0, [term], sizes, "bfloat16")
    nvlink = 2 * 7 / 8 * GB / 450e9  # 3.889 ms
    network = 2 * (2 - 1) / (2 * 8) * GB / 50e9  # 2.5 ms
    assert got.comm_s == pytest.approx(nvlink + network, rel=1e-12)
    assert got.comm_s == pytest.approx(6.3889e-3, rel=1e-4)
    assert got.latency_s == pytest.approx(20e-6, rel=1e-12)
    # a flat ring over the 16 at the NIC's bandwidth would take 37.5 ms
    assert got.comm_s < 2 * 15 / 16 * GB / 50e9 / 5


def test_data_outermost_crosses_the_network_and_tensor_does_not(h100):
    """data=2 × tensor=8 on 16 GPUs: each data pair spans both nodes (one member in each),
    each tensor group is one node. With the order reversed (tensor outermost), the tensor
    groups straddle the nodes (4 + 4) and the data pairs are neighbours."""
    sizes = _mesh(data=2, tensor=8)
    assert placements(("data",), sizes, 8) == {Placement(1, 2)}
    assert placements(("tensor",), sizes, 8) == {Placement(8, 1)}
    data = Term("all-reduce", "gradients", 1 * GB, 2, axes=("data",))
    tensor = Term("all-reduce", "activations", 1 * GB, 8, axes=("tensor",))
    assert step_time(h100, 0, 0, [data], sizes, "bfloat16").comm_s == pytest.approx(
        2 * (2 - 1) / 2 * GB / 50e9  # every byte over the NIC: 20 ms
    )
    assert step_time(h100, 0, 0, [tensor], sizes, "bfloat16").comm_s == pytest.approx(
        2 * 7 / 8 * GB / 450e9  # NVLink: 3.9 ms
    )
    reverse = {"tensor": 8, "data": 2}
    assert placements(("tensor",), reverse, 8) == {Placement(4, 2)}
    assert placements(("data",), reverse, 8) == {Placement(2, 1)}
    across = step_time(h100, 0, 0, [tensor], reverse, "bfloat16")
    assert across.comm_s == pytest.approx(2 * 3 / 4 * GB / 450e9 + 2 * 1 / 8 * GB / 50e9)
    assert step_time(h100, 0, 0, [data], reverse, "bfloat16").comm_s == pytest.approx(
        2 * 1 / 2 * GB / 450e9
    )


def test_a_pipeline_send_across_nodes_goes_at_the_network_bandwidth(h100):
    """Two stages of tensor=8 on 16 GPUs: every activation and gradient between them leaves
    the node (50 GB/s), and each send pays one network level of latency; the same stages
    inside one node send over NVLink."""
    sends = Term("collective-permute", "pipeline sends", 0.1 * GB, 2, 12, axes=("stage",))
    across = step_time(h100, 0, 0, [sends], _mesh(stage=2, tensor=8), "bfloat16")
    assert across.comm_s == pytest.approx(12 * 0.1 * GB / 50e9)  # 24 ms
    assert across.latency_s == pytest.approx(12 * 20e-6)
    inside = step_time(h100, 0, 0, [sends], _mesh(stage=2, tensor=4), "bfloat16")
    assert inside.comm_s == pytest.approx(12 * 0.1 * GB / 450e9)
    assert inside.latency_s == pytest.approx(12 * 10e-6)


def test_gb200_keeps_a_64_way_all_reduce_on_nvlink(h100):
    """GB200 NVL72: 64 GPUs are one NVLink domain; on H100s the same all-reduce spans 8
    nodes (3 levels of NCCL's tree). 128 GB200s fill the first rack's 72 and 56 of the
    next: the sparser rack's 56 set the pace across."""
    gb200 = replace(hardware.get_profile("gb200"), link_efficiency=1.0, network_efficiency=1.0)
    assert gb200.domain_devices == 72
    term = Term("all-reduce", "gradients", 1 * GB, 64, axes=("data",))
    sizes = _mesh(data=64)
    rack = step_time(gb200, 0, 0, [term], sizes, "bfloat16")
    assert rack.comm_s == pytest.approx(2 * 63 / 64 * GB / 900e9)
    assert rack.latency_s == pytest.approx(10e-6)
    nodes = step_time(h100, 0, 0, [term], sizes, "bfloat16")
    assert placements(("data",), sizes, 8) == {Placement(8, 8)}
    assert nodes.comm_s == pytest.approx(2 * 7 / 8 * GB / 450e9 + 2 * 7 / 64 * GB / 50e9)
    assert nodes.latency_s == pytest.approx(10e-6 + 3 * 10e-6)
    two = _mesh(data=128)
    assert placements(("data",), two, 72) == {Placement(56, 2)}
    wide = replace(term, group=128)
    assert step_time(gb200, 0, 0, [wide], two, "bfloat16").comm_s == pytest.approx(
        2 * 55 / 56 * GB / 900e9 + 2 * 1 / (2 * 56) * GB / 50e9
    )


def test_an_all_to_all_across_domains_is_bounded_by_the_network_share(h100):
    """Expert dispatch over 16 GPUs in 2 nodes: 8 of a device's 16 shares go to the other
    node through its NIC (the 7 for its own node go over NVLink at the same time)."""
    term = Term("all-to-all", "experts", 1.6 * GB, 16, 2, axes=("data", "fsdp"))
    got = step_time(h100, 0, 0, [term], _mesh(data=2, fsdp=8), "bfloat16")
    assert got.comm_s == pytest.approx(2 * 1.6 * GB * 8 / 16 / 50e9)


def _profile(tmp_path, **fields):
    """A --hardware-file with the H100's figures and ``fields``."""
    h100 = hardware.get_profile("h100")
    names = ("name", "flops_bf16", "flops_f32", "hbm_bandwidth", "memory_bytes")
    names += ("link_bandwidth", "links", "network_bandwidth", "collective_latency")
    entry = {f: getattr(h100, f) for f in names} | fields
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump({"mine": entry}))
    return path


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"domain_devices": -8}, "domain_devices=-8 must be a whole number at least 0"),
        ({"domain_devices": 8.5}, "domain_devices=8.5 must be a whole number at least 0"),
        ({"domain_devices": "eight"}, "domain_devices='eight' is not a number"),
        ({"network_latency": -1e-6}, "network_latency=-1e-06 must be a finite number at least 0"),
        ({"network_bandwidth": -1}, "network_bandwidth=-1 must be a finite number at least 0"),
        (
            {"domain_devices": 8, "network_bandwidth": 0},
            "domain_devices=8 ends an NVLink domain, so a layout of more chips crosses the "
            "network: give network_bandwidth (bytes/s per chip, one direction, e.g. 50e9 for "
            "400 Gb/s InfiniBand), or leave domain_devices out for one domain of every chip",
        ),
        ({"links": 2.5}, "links=2.5 must be a whole number at least 1"),
        ({"link_efficiency": 1.2}, "link_efficiency=1.2 must be above 0 and at most 1"),
        ({"network_efficiency": 0}, "network_efficiency=0 must be above 0 and at most 1"),
        ({"host_devices": 4.5}, "host_devices=4.5 must be a whole number at least 0"),
        (
            {"domain_devices": 8, "host_devices": 3},
            "host_devices=3 does not divide domain_devices=8; a domain holds whole hosts: "
            "give the GPUs one host drives, a divisor of the domain's",
        ),
    ],
)
def test_a_bad_network_field_is_one_line(tmp_path, fields, message):
    path = _profile(tmp_path, **fields)
    with pytest.raises(ConfigError) as err:
        hardware.get_profile("mine", path)
    assert str(err.value) == f"hardware profile 'mine': {message}"


def test_a_profile_of_one_domain_needs_no_network(tmp_path):
    """Without ``domain_devices`` nothing crosses a network, so ``network_bandwidth`` may be
    left out: the collectives go at NVLink's rate, hidden ones too, as with a network."""
    path = _profile(tmp_path)
    entry = yaml.safe_load(path.read_text())
    del entry["mine"]["network_bandwidth"]
    path.write_text(yaml.safe_dump(entry))
    mine = hardware.get_profile("mine", path)
    assert mine.network_bandwidth == 0
    terms = [
        Term("all-reduce", "grads", 1.6 * GB, 16, 1, axes=("data", "fsdp")),
        Term("all-gather", "weights", 0.8 * GB, 16, 1, axes=("fsdp",), hidden=True),
    ]
    got = step_time(mine, 0, 0, terms, _mesh(data=2, fsdp=8), "bfloat16")
    wide = hardware.get_profile("mine", _profile(tmp_path))  # the same, with a network
    assert got.comm_s == pytest.approx(2 * 1.6 * GB * 15 / 16 / mine.link_rate)
    assert got.hidden_s == pytest.approx(0.8 * GB * 15 / 16 / mine.link_rate)
    same = step_time(wide, 0, 0, terms, _mesh(data=2, fsdp=8), "bfloat16")
    assert (got.comm_s, got.hidden_s) == (same.comm_s, same.hidden_s)


def test_the_network_fields_are_optional_and_load_as_written(tmp_path):
    """A profile without them keeps every collective on NVLink (domain 0, no network
    latency); given, they load as their types; the built-in GPU profiles all name theirs."""
    mine = hardware.get_profile("mine", _profile(tmp_path))
    assert (mine.domain_devices, mine.network_latency) == (0, 0.0)
    mine = hardware.get_profile("mine", _profile(tmp_path, domain_devices="16"))
    assert mine.domain_devices == 16 and isinstance(mine.domain_devices, int)
    profiles = hardware.load_profiles()
    assert {k: p.domain_devices for k, p in profiles.items()} == {
        "h100": 8,
        "a3_high": 8,
        "h200": 8,
        "a100": 8,
        "a100_40": 8,
        "b200": 8,
        "gb200": 72,
    }
    # a host drives a domain (an 8-GPU server) but on GB200, whose 4-GPU trays fill a rack
    assert {k: p.devices_per_host for k, p in profiles.items()} == {
        **{k: 8 for k in profiles},
        "gb200": 4,
    }
    # InfiniBand HDR and NDR a GPU; a Google Cloud A3 High VM's 1,000 Gb/s over 8 GPUs
    assert {p.network_bandwidth for p in profiles.values()} == {25e9, 50e9, 15.625e9}
    assert all(p.network_latency == 10e-6 and p.source for p in profiles.values())


def test_collectives_go_at_the_share_of_the_wire_that_nccl_reaches(tmp_path, h100):
    """``link_efficiency`` and ``network_efficiency`` divide the wire's rate: the same
    all-reduce over two nodes of 8 takes 1/e longer on each kind of link; left out, a
    profile prices the datasheet's figures; the built-in ones carry the measured shares of
    NVLink (A100 78%, H100/H200/B200/GB200 82%) and the NIC's peak NCCL's developers give
    (24 of 25 GB/s for HDR, 48 of 50 for NDR: 96%), hardware.yaml's sources; A3 High's
    GPUDirect-TCPX has none cited."""
    term = Term("all-reduce", "grads", 1 * GB, 16, 1, axes=("data", "fsdp"))
    sizes = _mesh(data=2, fsdp=8)
    assert hardware.get_profile("h100").link_rate == pytest.approx(450e9 * 0.82)
    base = step_time(h100, 0, 0, [term], sizes, "bfloat16").comm_s
    inside = 2 * GB * 7 / 8 / 450e9
    assert base == pytest.approx(inside + 2 * GB / 2 / 8 / 50e9)
    slow = replace(h100, link_efficiency=0.5, network_efficiency=0.25)
    got = step_time(slow, 0, 0, [term], sizes, "bfloat16").comm_s
    assert got == pytest.approx(inside / 0.5 + 2 * GB / 2 / 8 / 50e9 / 0.25)
    assert hardware.roofline(slow, 0, 0, 1 * GB, "bfloat16").comm_s == pytest.approx(
        GB / 450e9 / 0.5
    )
    # an all-to-all goes where it is slower: the network here, NVLink once it is slow enough
    dispatch = Term("all-to-all", "experts", 1.6 * GB, 16, 2, axes=("data", "fsdp"))
    crawl = replace(h100, link_efficiency=0.05)
    got = step_time(crawl, 0, 0, [dispatch], sizes, "bfloat16").comm_s
    assert got == pytest.approx(2 * 1.6 * GB * 7 / 16 / (450e9 * 0.05))
    # the plan says the rate it priced, and the wire's share it is
    assert "bytes / 369 GB/s (82% of the wire's), 48 GB/s (96% of the wire's) and 10.0 µs a" in (
        format_plan([], hardware.get_profile("h100"), 80e9)
    )
    mine = hardware.get_profile("mine", _profile(tmp_path))
    assert (mine.link_rate, mine.network_rate) == (450e9, 50e9)
    shares = {
        k: (p.link_efficiency, p.network_efficiency) for k, p in hardware.load_profiles().items()
    }
    assert shares == {
        **{k: (0.82, 0.96) for k in ("h100", "h200", "b200", "gb200")},
        "a3_high": (0.82, 1.0),
        "a100": (0.78, 0.96),
        "a100_40": (0.78, 0.96),
    }
    real = step_time(hardware.get_profile("h100"), 0, 0, [term], sizes, "bfloat16").comm_s
    assert real == pytest.approx(inside / 0.82 + 2 * GB / 2 / 8 / 48e9)


@pytest.mark.parametrize(
    "model,layout",
    [
        (GPT_SMALL, "data=2,fsdp=2,tensor=2,tensor.sequence=true"),
        (GPT_SMALL, "data=2,context=2,stage=2"),
        (GPT_SMALL, "fsdp=4,context=2,context.attention=ulysses"),
        (GPT_SMALL, "data=4,context=2,context.attention=ring"),
        (GPT_SMALL, "data=2,tensor=2,stage=2,pipeline.executor=mpmd"),
        (MOE, "data=4,tensor=2,rules.experts=data"),
        (["model.name=resnet"], "data=4,tensor=2"),
    ],
)
def test_every_predicted_term_names_the_axes_of_its_group(model, layout):
    """The lab's terms say which mesh axes their group spans: its degree is the product of
    theirs, and a term of a split layout names at least one."""
    config = load_config([], model)
    run = build(apply_overrides(config, sweep.layout_overrides(layout)))
    sizes = dict(run.plan.mesh.shape)
    terms = predict.predict_comm(run, "gpu").terms
    assert terms
    for t in terms:
        assert t.axes, t
        assert math.prod(sizes[a] for a in t.axes) == t.group, t


def test_the_plan_prices_a_layout_that_leaves_the_domain(h100):
    """``data=8`` of a tiny GPT compiled once, read on the H100 (one 8-GPU domain) and on
    an H100 of 4-GPU domains: every gradient all-reduce then spans 2 domains of 4, its
    bytes split as the hierarchical formula says, and each collective pays one network
    level more; the measured bytes stand behind both (``scale``)."""
    # buckets after the backward pass: every all-reduce exposed (none overlaps a layer)
    lowered = measure.lower(load_config([], GPT_SMALL), "data=8,train.grad_bucket_mb=25", h100)
    compiled, seconds = measure.compile_lowered(lowered)
    whole = measure.read(lowered, compiled, seconds, h100)
    one = (whole.predicted_comm_s, whole.predicted_latency_s, whole.collective_ops)
    assert one[0] == pytest.approx(whole.comm_bytes / 450e9, rel=1e-9)
    halves = measure.read(lowered, compiled, seconds, replace(h100, domain_devices=4))
    per_byte = (2 * 3 / 4 / 450e9 + 2 * 1 / 8 / 50e9) / (2 * 7 / 8 / 450e9)
    assert halves.predicted_comm_s == pytest.approx(one[0] * per_byte, rel=1e-9)
    assert halves.predicted_latency_s == pytest.approx(one[2] * 20e-6, rel=1e-9)
    assert one[1] == pytest.approx(one[2] * 10e-6, rel=1e-9)


def test_mesh_hosts_put_the_degrees_they_name_across_domains(h100):
    """data=2 × stage=8 on two 8-GPU nodes: by default each replica's 8 stages fill a node
    and the data pairs cross; with ``mesh.hosts_stage=2`` (Megatron-LM's rank order: the
    pipeline outermost) each stage group straddles the nodes, 4 and 4, and the data pairs
    are neighbours. ``mesh.hosts_data=2`` is the default placement."""
    sizes = _mesh(data=2, stage=8)
    default = {"data": Placement(1, 2), "stage": Placement(8, 1)}
    swapped = {"data": Placement(2, 1), "stage": Placement(4, 2)}
    for hosts, want in ((None, default), ({"data": 2}, default), ({"stage": 2}, swapped)):
        ranks = None if hosts is None else grid_ranks(sizes, {**dict.fromkeys(sizes, 1), **hosts})
        for axis, placement in want.items():
            assert placements((axis,), sizes, 8, ranks) == {placement}, (hosts, axis)
    data = Term("all-reduce", "gradients", 1 * GB, 2, axes=("data",))
    hosts = {**dict.fromkeys(sizes, 1), "stage": 2}
    assert step_time(h100, 0, 0, [data], sizes, "bfloat16", hosts=hosts).comm_s == pytest.approx(
        2 * 1 / 2 * GB / 450e9  # NVLink, where by default every byte crosses the NIC
    )


def test_the_plan_prices_the_placement_mesh_hosts_choose(h100):
    """An estimate on 16 H100s (two 8-GPU hosts, each a domain) honours ``mesh.hosts_*``:
    naming the default placement changes nothing; putting ``tensor`` across the hosts
    sends its all-reduces over the network (priced as another framework's run would be:
    a jaxpar run refuses it, below); a host degree that does not divide its axis, or host
    degrees that do not multiply to the hosts, are refused in one line."""
    config = load_config([], GPT_SMALL)
    rows = {
        hosts: analytic.estimate(config, f"data=8,tensor=2{hosts}", h100, 16, processes=False)
        for hosts in ("", ",mesh.hosts_data=2", ",mesh.hosts_tensor=2")
    }
    assert all(r.ok for r in rows.values()), [r.error for r in rows.values()]
    default = rows[""].predicted_comm_s
    assert rows[",mesh.hosts_data=2"].predicted_comm_s == default
    assert rows[",mesh.hosts_tensor=2"].predicted_comm_s > 2 * default
    bad = analytic.estimate(config, "data=8,tensor=2,mesh.hosts_tensor=4", h100, 16)
    assert bad.error.startswith("host degrees (mesh.hosts_data=1, ") and bad.error.endswith(
        "multiply to 4 but the run has 2 processes; make their product 2"
    )
    many = analytic.estimate(config, "data=8,tensor=2,mesh.hosts_data=4", h100, 16)
    assert many.error.startswith("host degrees (mesh.hosts_data=4, ") and many.error.endswith(
        "multiply to 4 but the run has 2 processes; make their product 2"
    )
    # one host: nothing crosses, as a run of one process ignores them
    assert measure.lower(config, "data=4,tensor=2,mesh.hosts_tensor=3", h100).run


def test_a_cluster_plan_refuses_what_a_run_of_one_process_a_host_refuses(h100):
    """Each process of a multi-host run loads the rows its devices hold: on 16 H100s (two
    hosts) ``stage=4,tensor=4`` puts each host on two of the stages, both loading every
    row, and is priced; under the sub-mesh executor, which moves each process's own
    shards between the stages, it is refused in the run's own words, as is a placement
    whose hosts hold rows that are not one consecutive share (``fsdp`` across the hosts
    inside ``data``). As another framework's run (``processes=False``) both are priced."""
    config = load_config([], [*GPT_SMALL, "model.n_layers=4"])
    assert analytic.estimate(config, "stage=4,tensor=4", h100, 16).ok
    assert analytic.estimate(config, "data=2,stage=2,tensor=4,mesh.hosts_stage=2", h100, 16).ok
    mpmd = "stage=4,tensor=4,pipeline.executor=mpmd"
    assert analytic.estimate(config, mpmd, h100, 16).error.startswith(
        "pipeline.executor=mpmd moves each process's own shards between the stages, but the "
        "processes hold different places of the stages (the devices in process order, or "
        "mesh.hosts_*); put a whole axis other than stage across the hosts"
    )
    assert analytic.estimate(config, mpmd, h100, 16, processes=False).ok
    mixed = "data=2,fsdp=8,mesh.hosts_fsdp=2"
    assert analytic.estimate(config, mixed, h100, 16).error == (
        "batch 'tokens': the processes split the mesh along fsdp, so a process's devices "
        "hold rows of the 16 row blocks (data×fsdp) that are not one consecutive share, but "
        "each process loads one run of rows; let the hosts cross data, the outer batch axis, "
        "first (mesh.hosts_data; mesh.hosts_fsdp above 1 only once mesh.hosts_data = "
        "mesh.data)"
    )
    assert analytic.estimate(config, mixed, h100, 16, processes=False).ok
    assert analytic.estimate(config, "data=2,fsdp=8,mesh.hosts_data=2", h100, 16).ok
