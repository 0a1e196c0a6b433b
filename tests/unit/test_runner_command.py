"""The llama-server command line: every allocation setting pinned from the stamp, as an argument list."""

from __future__ import annotations

import msgspec
import pytest

from actors.runner.command import build_command, server_environment
from messages.placement import Reservation, RpcMember, Stamp
from messages.settings import ServingSettings
from tests.llama_harness import server_args

#: The flag that pins each ServingSettings field. A new field must get a flag here, and in the command.
FLAGS = {
    "slots": "-np",
    "kv_unified": "-kvu/-no-kvu",
    "cache_type_k": "-ctk",
    "cache_type_v": "-ctv",
    "flash_attn": "-fa",
    "batch": "-b",
    "ubatch": "-ub",
    "swa_full": "--swa-full",
    "spec_type": "--spec-type",
    "spec_draft_n_max": "--spec-draft-n-max",
    "spec_draft_type_k": "-ctkd",
    "spec_draft_type_v": "-ctvd",
    "ctx_checkpoints": "--ctx-checkpoints",
    "cache_ram_mib": "--cache-ram",
    "threads": "-t/-tb",
    "kind": "--embeddings/--rerank",
    "pooling": "--pooling",
}


def _reservation(
    settings: ServingSettings,
    *,
    ctx: int = 8192,
    ngl: int = 0,
    split: tuple[float, ...] = (),
    members: tuple[RpcMember, ...] = (),
) -> Reservation:
    return Reservation(
        reservation_id="r1",
        decision_id="d1",
        node_id="n1",
        state="reserved",
        model_path="/models/my model.gguf",
        stamp=Stamp(settings=settings, ctx=ctx, n_gpu_layers=ngl, gpu_split=split, rpc=members),
        layers=(0, 4),
        devices=(),
        held={},
        created_at=0.0,
    )


def _value(argv: tuple[str, ...], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times"
    return argv[argv.index(flag) + 1]


def test_every_serving_setting_has_a_pinning_flag() -> None:
    assert set(FLAGS) == set(ServingSettings.__struct_fields__)


def test_every_allocation_setting_is_pinned_with_the_stamped_value() -> None:
    settings = ServingSettings(
        slots=3,
        kv_unified=True,
        cache_type_k="q8_0",
        cache_type_v="q4_0",
        flash_attn="on",
        batch=1024,
        ubatch=256,
        swa_full=True,
        spec_type="draft-mtp",
        spec_draft_n_max=5,
        spec_draft_type_k="q8_0",
        spec_draft_type_v="bf16",
        ctx_checkpoints=4,
        cache_ram_mib=0,
        threads=3,
    )
    argv = build_command("/opt/llama-server", _reservation(settings, ctx=6000, ngl=99), port=8111, slot_save_dir="/d")
    assert argv[0] == "/opt/llama-server"
    expected = {
        "-m": "/models/my model.gguf",  # one argument, spaces and all: there is no shell
        "-c": "6000",
        "-np": "3",
        "-ctk": "q8_0",
        "-ctv": "q4_0",
        "-fa": "on",
        "-b": "1024",
        "-ub": "256",
        "--spec-type": "draft-mtp",
        "--spec-draft-n-max": "5",
        "-ctkd": "q8_0",
        "-ctvd": "bf16",
        "-ngl": "99",
        "--ctx-checkpoints": "4",
        "--cache-ram": "0",
        "-t": "3",
        "-tb": "3",
        "--fit": "off",
        "-lv": "4",
        "--host": "127.0.0.1",
        "--port": "8111",
        "--slot-save-path": "/d",
    }
    assert {flag: _value(argv, flag) for flag in expected} == expected
    assert "-kvu" in argv and "-no-kvu" not in argv
    assert "--swa-full" in argv and "--no-warmup" in argv
    assert "--metrics" in argv  # its /metrics, which the node's metrics re-export
    assert "-ts" not in argv


def test_defaults_are_pinned_too_and_negative_forms_are_explicit() -> None:
    argv = build_command("llama-server", _reservation(ServingSettings()), port=1, slot_save_dir="/d")
    assert "-no-kvu" in argv and "-kvu" not in argv
    assert "--swa-full" not in argv  # no negative flag exists; the server's default is the window-sized cache
    assert "-t" not in argv and "-tb" not in argv  # threads 0: llama-server's own default, every core
    assert _value(argv, "--spec-type") == "none"
    assert _value(argv, "--spec-draft-n-max") == "3"
    assert _value(argv, "--cache-ram") == "8192"
    assert all(isinstance(arg, str) for arg in argv)


def test_gpu_split_is_passed_as_tensor_split_weights() -> None:
    argv = build_command("s", _reservation(ServingSettings(), ngl=-1, split=(3.0, 1.5)), port=2, slot_save_dir="/d")
    assert _value(argv, "-ts") == "3.0,1.5"
    assert _value(argv, "-ngl") == "-1"


def test_command_pins_what_the_memory_tests_validated_against_the_server() -> None:
    """The e2e memory tests prove the model exact for servers started with `server_args`; the runner's
    command must pin the same flags to the same values (it may add supervision flags)."""
    settings = msgspec.convert(
        {"slots": 4, "spec_type": "draft-mtp", "spec_draft_n_max": 2, "swa_full": True}, ServingSettings
    )
    argv = build_command("s", _reservation(settings, ctx=8192), port=3, slot_save_dir="/d")
    validated = server_args(settings, 8192)
    i = 0
    while i < len(validated):
        flag = validated[i]
        if i + 1 < len(validated) and not validated[i + 1].startswith("-"):
            assert _value(argv, flag) == validated[i + 1], flag
            i += 2
        else:
            assert flag in argv, flag
            i += 1


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_a_port_outside_the_tcp_range_is_refused(port: int) -> None:
    with pytest.raises(ValueError, match="port"):
        build_command("s", _reservation(ServingSettings()), port=port, slot_save_dir="/d")


def test_server_environment_drops_llama_arg_variables_that_would_set_unpinned_flags() -> None:
    env = {
        "PATH": "/bin",
        "LLAMA_ARG_N_PARALLEL": "8",
        "LLAMA_ARG_KV_UNIFIED_PER_SLOT": "1",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    assert server_environment(env) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"}


@pytest.mark.parametrize(
    ("kind", "pooling", "flag"), [("embedding", "mean", "--embeddings"), ("rerank", "rank", "--rerank")]
)
def test_an_embedding_or_rerank_server_is_pinned_with_its_kind_pooling_and_whole_input_batch(
    kind: str, pooling: str, flag: str
) -> None:
    settings = msgspec.convert({"kind": kind, "pooling": pooling, "batch": 4096, "ubatch": 4096}, ServingSettings)
    argv = build_command("s", _reservation(settings, ctx=8192), port=4, slot_save_dir="/d")
    assert flag in argv and _value(argv, "--pooling") == pooling
    assert _value(argv, "-b") == _value(argv, "-ub") == "4096"
    other = "--rerank" if flag == "--embeddings" else "--embeddings"
    assert other not in argv
    assert server_args(settings, 8192)[-3:] == [flag, "--pooling", pooling]  # the harness runs what the runner runs


def test_a_generation_server_passes_neither_embeddings_nor_pooling() -> None:
    argv = build_command("s", _reservation(ServingSettings()), port=5, slot_save_dir="/d")
    assert not {"--embeddings", "--rerank", "--pooling"} & set(argv)


# --- a split's members (--rpc) -------------------------------------------------------------------------------

MEMBERS = (RpcMember(node_id="m2", layers=(8, 16)), RpcMember(node_id="m3", layers=(16, 24)))


def test_a_split_names_its_members_endpoints_in_the_given_order_before_the_tensor_split() -> None:
    """llama.cpp numbers the RPC devices in `--rpc` order, ahead of the head's GPUs; `-ts` weighs them in
    that order, so the endpoints must be passed as given (the stamp's member order) and before `-ts`."""
    reservation = _reservation(ServingSettings(), ngl=99, split=(1.0, 2.0, 3.0), members=MEMBERS)
    rpc = ("127.0.0.1:4002", "127.0.0.1:4001")
    argv = build_command("s", reservation, port=6, slot_save_dir="/d", rpc=rpc)
    assert _value(argv, "--rpc") == "127.0.0.1:4002,127.0.0.1:4001"
    assert argv.index("--rpc") < argv.index("-ts")
    assert _value(argv, "-ts") == "1.0,2.0,3.0"


def test_a_split_without_head_gpus_still_gets_its_members() -> None:
    reservation = _reservation(ServingSettings(), ngl=99, members=MEMBERS[:1])
    argv = build_command("s", reservation, port=6, slot_save_dir="/d", rpc=("127.0.0.1:4001",))
    assert _value(argv, "--rpc") == "127.0.0.1:4001"
    assert "-ts" not in argv


@pytest.mark.parametrize(
    ("members", "rpc"),
    [
        (MEMBERS, ("127.0.0.1:4001",)),  # fewer endpoints than members
        (MEMBERS[:1], ("127.0.0.1:4001", "127.0.0.1:4002")),  # more
        ((), ("127.0.0.1:4001",)),  # endpoints for an instance that is not split
        (MEMBERS, ()),  # a split started without its members
    ],
)
def test_endpoints_that_do_not_match_the_stamps_members_are_refused(
    members: tuple[RpcMember, ...], rpc: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError, match="split members"):
        build_command("s", _reservation(ServingSettings(), members=members), port=7, slot_save_dir="/d", rpc=rpc)


def test_an_instance_that_is_not_split_gets_no_rpc() -> None:
    argv = build_command("s", _reservation(ServingSettings(), ngl=99, split=(1.0, 1.0)), port=8, slot_save_dir="/d")
    assert "--rpc" not in argv
