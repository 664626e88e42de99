"""The run contract (inflight/wire/contract.py): one definition of what serve and learner must agree on, its defaults
shared by every config, sent in Hello, and every differing field named with its fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from inflight.learn.config import LearnConfig
from inflight.run.config import RunConfig
from inflight.run.launch import side_commands
from inflight.serve.config import ServeConfig
from inflight.wire.contract import GROUP_SIZE, TEMPERATURE, RunContract, SharedKnobs
from inflight.wire.control import CONTROL_SCHEMA, ControlError, Hello, decode_control, encode_control

LEARNER = RunContract(group_size=8, temperature=1.0, dtype="float32")


@pytest.mark.parametrize(
    ("field", "value", "named", "fix"),
    [
        ("group_size", 4, "group_size 4, but this learner trains groups of 8", "--group-size"),
        ("temperature", 0.7, "temperature 0.7, but this learner computes logprobs at temperature 1.0", "--temperature"),
        ("top_p", 0.9, "top_p 0.9, but this learner computes logprobs under top_p 1.0", "--top-p"),
        ("top_k", 50, "top_k 50, but this learner computes logprobs under top_k 0", "--top-k"),
        ("min_p", 0.05, "min_p 0.05, but this learner computes logprobs under min_p 0.0", "--min-p"),
        ("dtype", "bfloat16", "dtype bfloat16, but this learner computes in float32", "--dtype float32"),
    ],
)
def test_a_serve_differing_in_one_field_is_told_that_field_both_values_and_the_flag_that_fixes_it(
    field, value, named, fix
):
    serve = msgspec.structs.replace(LEARNER, **{field: value})
    reason = serve.mismatch(LEARNER, "infer3@1")
    assert reason.startswith(f"serve infer3@1: {named}") and fix in reason, reason


def test_the_first_differing_field_is_the_one_named():
    serve = RunContract(group_size=4, temperature=0.5, dtype="bfloat16")
    assert "group_size 4" in serve.mismatch(LEARNER, "s") and "temperature" not in serve.mismatch(LEARNER, "s")


def test_equal_contracts_agree_and_a_temperature_given_as_the_same_decimal_is_the_same():
    assert LEARNER.mismatch(LEARNER, "s") == ""
    assert RunContract(temperature=float("0.7"), dtype="float32").mismatch(
        RunContract(temperature=0.7, dtype="float32"), "s"
    ) == ""  # fmt: skip


def test_the_dtype_refusal_keeps_the_measured_reason():
    reason = RunContract(dtype="float32").mismatch(RunContract(dtype="bfloat16"), "s")
    assert "drift apart" in reason and "0.015 -> 0.56" in reason and "--autocast none" in reason


@pytest.mark.parametrize("dtype", ["auto", "", "none"])
def test_a_contract_never_carries_an_unresolved_dtype(dtype):
    with pytest.raises(ValueError, match=f"RunContract.dtype is {dtype!r}: it carries the resolved compute dtype"):
        RunContract(dtype=dtype)


def test_serve_learn_and_run_take_their_shared_defaults_from_the_contract_and_agree_out_of_the_box():
    for cfg in (ServeConfig(), LearnConfig(), RunConfig()):
        assert (cfg.group_size, cfg.temperature) == (GROUP_SIZE, TEMPERATURE), type(cfg).__name__
    serve = ServeConfig(dtype="float32").contract()
    assert serve.top_k == 0  # off, spelled 0 on every side: the learner's full softmax
    assert serve.mismatch(LearnConfig(autocast="none").contract(), "s") == ""


def test_the_learners_compute_dtype_is_its_autocast_dtype_or_its_parameter_dtype_without_autocast():
    assert LearnConfig(autocast="bfloat16").contract().dtype == "bfloat16"
    assert LearnConfig(autocast="none", dtype="bfloat16").contract().dtype == "bfloat16"
    assert LearnConfig(autocast="none").contract().dtype == "float32"
    with pytest.raises(ValueError, match="resolve"):
        LearnConfig(autocast="auto").contract()  # main resolves it before the learner starts


def test_inflight_run_gives_the_learner_the_serves_group_size():
    commands = side_commands(RunConfig(group_size=3), Path("/nonexistent-run-dir"), (1, 2, 3))
    learn, serve = commands["learn"], commands["serve"]
    assert learn[learn.index("--group-size") + 1] == serve[serve.index("--group-size") + 1] == "3"


def test_hello_carries_the_contract_and_an_old_schema_hello_is_refused_naming_the_schemas():
    hello = Hello(server_id="s", contract=RunContract(group_size=4, dtype="bfloat16"))
    assert decode_control(encode_control(hello), to="learner").contract == hello.contract
    old = msgspec.msgpack.encode({"type": "hello", "schema": 1, "server_id": "s", "model": "m"})  # no contract
    with pytest.raises(ControlError, match=f"Hello.schema is 1, expected {CONTROL_SCHEMA}: run the same inflight"):
        decode_control(old, to="learner")
    no_min_p = msgspec.msgpack.encode({"type": "hello", "schema": 2, "contract": {"dtype": "float32"}})  # before min_p
    with pytest.raises(ControlError, match=f"Hello.schema is 2, expected {CONTROL_SCHEMA}"):
        decode_control(no_min_p, to="learner")
    unresolved = msgspec.msgpack.encode({"type": "hello", "schema": CONTROL_SCHEMA, "contract": {"dtype": "auto"}})
    with pytest.raises(ControlError, match="resolved compute dtype"):
        decode_control(unresolved, to="learner")


def test_lm_head_precisions_that_differ_warn_with_the_fix_and_are_never_refused():
    learner = RunContract(dtype="bfloat16", head_dtype="float32")  # bf16 autocast, fp32 parameters (its head)
    bf16_head = RunContract(dtype="bfloat16", head_dtype="bfloat16")
    assert bf16_head.mismatch(learner, "s@1") == ""
    warning = bf16_head.head_warning(learner, "s@1")
    assert "LM head in bfloat16, this learner in float32" in warning and "--head-dtype float32" in warning
    assert RunContract(dtype="bfloat16", head_dtype="float32").head_warning(learner, "s@1") == ""
    assert RunContract(dtype="bfloat16").head_warning(learner, "s@1") == ""  # a serve that did not say


def test_the_serve_and_learner_configs_declare_their_heads_precision():
    from inflight.learn.config import LearnConfig
    from inflight.serve.config import ServeConfig

    assert ServeConfig(dtype="bfloat16").contract().head_dtype == "float32"  # --head-dtype float32 by default
    assert ServeConfig(dtype="bfloat16", head_dtype="model").contract().head_dtype == "bfloat16"
    assert LearnConfig(dtype="float32", autocast="bfloat16").contract().head_dtype == "float32"


def test_every_shared_knob_is_declared_once_and_reaches_each_config_with_the_same_default_and_help():
    """ServeConfig, LearnConfig and RunConfig inherit SharedKnobs: one declaration, so no side can drift."""
    shared = {f.name: f for f in dataclasses.fields(SharedKnobs)}
    assert {"group_size", "temperature", "top_p", "top_k", "min_p"} <= set(shared)
    for cls in (ServeConfig, LearnConfig, RunConfig):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, declared in shared.items():
            assert fields[name].default == declared.default, (cls.__name__, name)
            assert fields[name].metadata is declared.metadata, (cls.__name__, name)  # the very same declaration


def test_a_run_flag_that_forwards_a_sides_knob_has_that_knobs_default_and_help():
    run = {f.name: f for f in dataclasses.fields(RunConfig)}
    for side, names in (
        (ServeConfig, ("admit_lag", "max_tokens", "mode", "task", "env")),
        (LearnConfig, ("max_lag", "lr")),
    ):
        own = {f.name: f for f in dataclasses.fields(side)}
        for name in names:
            assert run[name].default == own[name].default, name
            assert run[name].metadata["help"].endswith(own[name].metadata["help"]), name


@pytest.mark.parametrize("cls", [ServeConfig, LearnConfig, RunConfig])
def test_top_k_minus_one_is_refused_on_every_side_naming_zero_as_the_one_spelling_of_off(cls):
    with pytest.raises(ValueError, match=r"--top-k is -1, expected 0 for off"):
        cls(top_k=-1).validate()
    cls(top_k=0).validate_shared()  # 0 = off, accepted everywhere
