"""The HLO reader on a fixed module: collectives inside and outside while loops."""

from jaxpar import hlo

MODULE = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%branch_0 (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  ROOT %ar.1 = f32[4] all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

%branch_1 (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  ROOT %cp = f32[4] collective-permute(%p), source_target_pairs={{0,1},{1,0}}
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4] get-tuple-element(%t), index=1
  %c = f32[4] conditional(%i, %x, %x), branch_computations={%branch_0, %branch_1}
  ROOT %r = (s32[], f32[4]) tuple(%i, %c)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (x: f32[4]) -> (f32[4], f32[4]) {
  %x = f32[4] parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[4]) tuple(%z, %x)
  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body
  %y = f32[4] get-tuple-element(%w), index=1
  %ar.2 = (f32[4], f32[4]) all-reduce(%y, %x), replica_groups={{0,1}}, to_apply=%add
  ROOT %g = f32[4] get-tuple-element(%ar.2), index=0
}
"""


def test_loop_computations_follow_body_and_every_branch():
    assert hlo.loop_computations(MODULE) >= {"body", "branch_0", "branch_1"}
    assert "main" not in hlo.loop_computations(MODULE)


def test_count_ops_inside_and_outside_loops():
    assert hlo.count_ops(MODULE, "all-reduce") == 2
    assert hlo.count_ops(MODULE, "all-reduce", in_loops=True) == 1  # in branch 0
    assert hlo.count_ops(MODULE, "all-reduce", in_loops=False) == 1  # the tuple one
    assert hlo.count_ops(MODULE, "collective-permute", in_loops=True) == 1  # in branch 1
    assert hlo.count_ops(MODULE, "conditional", in_loops=True) == 1
    assert hlo.count_ops(MODULE, "all-gather") == 0


def test_branch_names_without_percent_signs():
    plain = MODULE.replace("%branch_0, %branch_1", "branch_0, branch_1")
    assert hlo.loop_computations(plain) >= {"branch_0", "branch_1"}
