"""vLLM launch lines for DeepSeek models parse: published `vllm serve` lines, the flags this server
names as unsupported, human-readable lengths, dtype spellings, logging and served-name flags,
and the --chat-template / --generation-config flags with their errors (the HTTP side of vLLM's
extras: tests/test_vllm_compat.py)."""

from __future__ import annotations

import shlex

import pytest

from common.args import EngineArgs, human_readable_int
from server.cli import build_parser, engine_args_from
from server.vllm_flags import check_quantization
from tests.server_fixtures import TINY_MODEL


# Real launch lines, copied from where they were published (the model is then replaced by the
# tiny model's directory: these checkpoints are not on this machine).
ACCEPTED = [
    # docs.vllm.ai recipes, DeepSeek-V3 (R1), 8xH200: DP8+EP (data-parallel attention, experts over all 8)
    ("vllm serve deepseek-ai/DeepSeek-R1-0528 --trust-remote-code --data-parallel-size 8 "
     "--enable-expert-parallel", dict(data_parallel_size=8, enable_expert_parallel=True, tensor_parallel_size=1)),
    ("vllm serve deepseek-ai/DeepSeek-R1-0528 --trust-remote-code --data-parallel-size 8",
     dict(data_parallel_size=8, enable_expert_parallel=False)),
    # deepseek.csdn.net/6805bfcfda5d787fd5d0ee89.html (underscored flag names, as vLLM allows): a
    # bf16 checkpoint (the tiny model stands in) with --quantization fp8, quantized at load as vLLM does
    ("vllm serve /home/ca2/models/DeepSeek-R1-Distill-Qwen-32B --dtype bfloat16 --max_model_len 32384 "
     "--gpu_memory_utilization 0.8 --host 0.0.0.0 --port 5000 --quantization fp8 --enforce-eager",
     dict(quantization="fp8", max_model_len=32384, enforce_eager=True)),
    # DeepSeek-R1 model card, "Usage Recommendations" (as quoted by cloud.tencent.com/developer/article/2493720)
    ("vllm serve deepseek-ai/DeepSeek-R1-Distill-Qwen-32B --tensor-parallel-size 2 "
     "--max-model-len 32768 --enforce-eager",
     dict(tensor_parallel_size=2, max_model_len=32768, enforce_eager=True)),
    # huggingface.co/deepseek-ai/DeepSeek-V3, "Use this model" -> vLLM
    ('vllm serve "deepseek-ai/DeepSeek-V3"', {}),
    # huggingface.co/deepseek-ai/DeepSeek-V3.2, "Use this model" -> vLLM
    ('vllm serve "deepseek-ai/DeepSeek-V3.2"', {}),
    # gitee.com/learnllms/all-about-llms/pulls/1: docker run ... vllm/vllm-openai:latest <args>
    ("--model /models/70b --served-model-name deepseek-r1:70b --tensor-parallel-size 2 "
     "--gpu-memory-utilization 0.9 --trust-remote-code --dtype bfloat16 --max-model-len 8192 "
     "--api-key 123456 --host 0.0.0.0 --port 10001",
     dict(served_model_name=["deepseek-r1:70b"], tensor_parallel_size=2, gpu_memory_utilization=0.9,
          dtype="bfloat16", max_model_len=8192)),
    # docs.vllm.ai recipes, DeepSeek-V3 (R1) "Additional flags" on top of the TP line's model
    ("vllm serve deepseek-ai/DeepSeek-R1-0528 --trust-remote-code --tensor-parallel-size 8 "
     "--max-model-len=65536 --max-num-batched-tokens=32768 --gpu-memory-utilization=0.95",
     dict(tensor_parallel_size=8, max_model_len=65536, max_num_batched_tokens=32768,
          gpu_memory_utilization=0.95)),
    # docs.vllm.ai recipes, DeepSeek-V3 (R1), 8xH200: TP8+EP
    ("vllm serve deepseek-ai/DeepSeek-R1-0528 --trust-remote-code --tensor-parallel-size 8 "
     "--enable-expert-parallel",
     dict(tensor_parallel_size=8, enable_expert_parallel=True)),
    ("vllm serve deepseek-ai/DeepSeek-V3 -tp 8 -ep", dict(tensor_parallel_size=8, enable_expert_parallel=True)),
    # --compilation-config's CUDA-graph keys (vLLM's CompilationConfig), and those accepted as no-ops here
    ("vllm serve deepseek-ai/DeepSeek-V3 -tp 8 --compilation-config "
     "'{\"cudagraph_mode\": \"FULL_AND_PIECEWISE\", \"custom_ops\": [\"all\"]}'",
     dict(tensor_parallel_size=8, enforce_eager=False, piecewise_graph_sizes="auto", cuda_graph_sizes=None)),
    ("vllm serve deepseek-ai/DeepSeek-V3 --compilation-config '{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}'",
     dict(enforce_eager=False, piecewise_graph_sizes="none")),
    ("vllm serve deepseek-ai/DeepSeek-V3 --compilation-config '{\"cudagraph_mode\": \"NONE\", \"level\": 0}'",
     dict(enforce_eager=True)),
    ("vllm serve deepseek-ai/DeepSeek-V3 --compilation-config '{\"cudagraph_capture_sizes\": [1, 2, 4, 8, 16]}'",
     dict(cuda_graph_sizes=(1, 2, 4, 8, 16))),
    ("vllm serve deepseek-ai/DeepSeek-V3 --compilation-config '{\"cudagraph_capture_sizes\": [24]}'",
     dict(cuda_graph_sizes=(24,))),
    ("vllm serve deepseek-ai/DeepSeek-V3 --max-num-seqs 64 --compilation-config "
     "'{\"max_cudagraph_capture_size\": 40}'", dict(cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 40))),
    ("vllm serve deepseek-ai/DeepSeek-V3 --compilation-config 3", dict(enforce_eager=False)),
    # a vLLM bug report ("'_moe_C' object has no attribute 'moe_align_block_size'"), DeepSeek-V3
    ("vllm serve xxx --served-model-name deepseek-v3 -tp 8 --gpu-memory-utilization 0.85 "
     "--max-model-len 65536 --enable-auto-tool-choice --tool-call-parser deepseek_v3",
     dict(served_model_name=["deepseek-v3"], tensor_parallel_size=8, max_model_len=65536)),
]
REJECTED = [
    # docs.vllm.ai/projects/ascend, context parallel guide (DeepSeek-V2-Lite)
    ("vllm serve deepseek-ai/DeepSeek-V2-Lite --tensor-parallel-size 2 "
     "--decode-context-parallel-size 2 --prefill-context-parallel-size 2",
     ["--prefill-context-parallel-size"]),
    # github.com/vllm-project/vllm/issues/40778
    ("vllm serve /data/pretrained/DeepSeek-V4-Flash --served-model-name DeepSeek-V4-Flash "
     "--trust-remote-code --kv-cache-dtype fp8 --block-size 256 --enable-expert-parallel "
     "--data-parallel-size 8 --gpu-memory-utilization 0.85 "
     "--compilation-config '{\"cudagraph_mode\":\"FULL_AND_PIECEWISE\", \"custom_ops\":[\"all\"]}' "
     "--attention_config.use_fp4_indexer_cache=True --tokenizer-mode deepseek_v4 "
     "--tool-call-parser deepseek_v4 --enable-auto-tool-choice --reasoning-parser deepseek_v4",
     ["--attention_config.use_fp4_indexer_cache"]),
]


# flags this server takes with one value only (vLLM's no-ops here): another value is an error
# naming the flag and the value it takes
REFUSED_VALUES = [
    # docs.vllm.ai recipes, DeepSeek-V3.2
    ("vllm serve deepseek-ai/DeepSeek-V3.2 --tensor-parallel-size 8 --tokenizer-mode deepseek_v32 "
     "--tool-call-parser deepseek_v32 --enable-auto-tool-choice --reasoning-parser deepseek_v3",
     "--tokenizer-mode deepseek_v32: only auto is supported"),
    ("vllm serve deepseek-ai/DeepSeek-V3 --compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}'",
     "cudagraph_mode 'PIECEWISE': this server captures decode steps whole"),
    ("vllm serve deepseek-ai/DeepSeek-V3 --compilation-config '{\"pass_config\": {}, \"level\": 3}'",
     "--compilation-config: 'pass_config' not supported here"),
    ("vllm serve deepseek-ai/DeepSeek-V3 --compilation-config '[1, 2]'",
     "--compilation-config must be a JSON object"),
    ("vllm serve deepseek-ai/DeepSeek-V3 --cuda-graph-sizes 8 --compilation-config "
     "'{\"cudagraph_capture_sizes\": [8]}'",
     "--cuda-graph-sizes and --compilation-config cudagraph_capture_sizes: give one of them"),
    ("vllm serve deepseek-ai/DeepSeek-V3 --piecewise-graph-sizes 512 --compilation-config "
     "'{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}'",
     "cudagraph_mode FULL_DECODE_ONLY and --piecewise-graph-sizes 512: give one of them"),
    ("vllm serve deepseek-ai/DeepSeek-V3 --compilation-config '{\"cudagraph_capture_sizes\": [0, 8]}'",
     "cudagraph_capture_sizes must be >= 1, got 0"),
    ("vllm serve deepseek-ai/DeepSeek-R1-0528 -dp 3 --nnodes 2 --master-port 29500",
     "--nnodes 2 must divide --tensor-parallel-size 1 x --data-parallel-size 3"),
]
# launch lines of FP8 checkpoints with --quantization fp8: the model is replaced by a copy of the
# tiny model whose config.json carries DeepSeek-V3's quantization_config
FP8_LINES = [
    # docs.vultr.com inference cookbook, DeepSeek V3.2 page (vllm serve, then the docker form)
    "vllm serve deepseek-ai/DeepSeek-V3-0324 --tensor-parallel-size 8 --max-model-len 32768 "
    "--gpu-memory-utilization 0.90 --trust-remote-code --quantization fp8 --block-size 1",
    "--model deepseek-ai/DeepSeek-V3-0324 --tensor-parallel-size 8 --max-model-len 32768 "
    "--gpu-memory-utilization 0.90 --trust-remote-code --quantization fp8 --block-size 1",
]


def _argv(line: str) -> list[str]:
    argv = shlex.split(line)
    return argv[2:] if argv[:2] == ["vllm", "serve"] else argv


def _local(ns):
    """The parsed line with its model replaced by the tiny model's directory."""
    if ns.model_tag is not None:
        ns.model_tag = str(TINY_MODEL)
    else:
        ns.model = str(TINY_MODEL)
    return ns


@pytest.mark.parametrize("line,want", ACCEPTED, ids=[f"ok{i}" for i in range(len(ACCEPTED))])
def test_vllm_launch_lines_parse(line, want):
    ns = build_parser().parse_args(_argv(line))
    a = engine_args_from(_local(ns))
    assert a.model == str(TINY_MODEL)
    for field, value in want.items():
        assert getattr(a, field) == value, field


@pytest.mark.parametrize("line", FP8_LINES)
def test_fp8_checkpoint_lines_with_quantization_parse(line, tmp_path):
    import json
    import shutil
    fp8 = tmp_path / "fp8"
    shutil.copytree(TINY_MODEL, fp8)
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    ns = build_parser().parse_args(_argv(line))
    if ns.model_tag is not None:
        ns.model_tag = str(fp8)
    else:
        ns.model = str(fp8)
    a = engine_args_from(ns)
    assert (a.model, a.tensor_parallel_size, a.max_model_len, a.block_size) == (str(fp8), 8, 32768, 1)


@pytest.mark.parametrize("line,flags", REJECTED, ids=[f"refused{i}" for i in range(len(REJECTED))])
def test_unsupported_vllm_flags_are_named(line, flags, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(_argv(line))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("serve: error: unsupported flag"), err
    named = err[0].split(": ", 3)[3].split(" (")[0].split(", ")
    assert named == flags


@pytest.mark.parametrize("line,message", REFUSED_VALUES, ids=[f"value{i}" for i in range(len(REFUSED_VALUES))])
def test_no_op_flags_with_other_values_are_named(line, message):
    with pytest.raises(ValueError, match=message):
        engine_args_from(_local(build_parser().parse_args(_argv(line))))


def test_positional_model_and_model_flag():
    p = build_parser()
    assert engine_args_from(p.parse_args([str(TINY_MODEL), "-tp", "2"])).model == str(TINY_MODEL)
    assert engine_args_from(p.parse_args(["-tp", "2", str(TINY_MODEL)])).model == str(TINY_MODEL)
    assert engine_args_from(p.parse_args(["--model", str(TINY_MODEL)])).model == str(TINY_MODEL)
    assert engine_args_from(p.parse_args([str(TINY_MODEL), "--model", str(TINY_MODEL)])).model == str(TINY_MODEL)
    with pytest.raises(ValueError, match="named twice"):
        engine_args_from(p.parse_args(["/a", "--model", str(TINY_MODEL)]))


@pytest.mark.parametrize("text,want", [("32768", 32768), ("32k", 32000), ("32K", 32768),
                                       ("1.5k", 1500), ("128K", 131072), ("1m", 1_000_000),
                                       ("2M", 2 * 2**20), (" 8k ", 8000)])
def test_human_readable_lengths(text, want):
    assert human_readable_int(text) == want
    ns = build_parser().parse_args(["--max-model-len", text, "--max-num-batched-tokens", text])
    assert ns.max_model_len == ns.max_num_batched_tokens == want


@pytest.mark.parametrize("text", ["auto", "AUTO", "-1"])
def test_max_model_len_auto(text):
    """vLLM's `--max-model-len auto` (or -1): the engine fits it to the KV cache."""
    ns = build_parser().parse_args(["--max-model-len", text])
    assert ns.max_model_len == "auto" and engine_args_from(ns).max_model_len == "auto"


@pytest.mark.parametrize("text", ["1.5K", "32kb", "k", "-", "-2", "autox"])
def test_bad_lengths_are_refused(text, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-model-len", text])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-model-len" in err[0]


@pytest.mark.parametrize("spelling,want", [("half", "float16"), ("float16", "float16"),
                                           ("bfloat16", "bfloat16"), ("bf16", "bfloat16"),
                                           ("float32", "float32"), ("float", "float32"), ("auto", "auto")])
def test_dtype_spellings(spelling, want):
    ns = build_parser().parse_args(["--model", str(TINY_MODEL), "--dtype", spelling])
    assert engine_args_from(ns).dtype == want
    assert EngineArgs(model=str(TINY_MODEL), dtype=spelling).dtype == want


def test_log_request_flags():
    p = build_parser()
    base = ["--model", str(TINY_MODEL)]
    assert not engine_args_from(p.parse_args(base)).enable_log_requests
    assert engine_args_from(p.parse_args(base + ["--enable-log-requests"])).enable_log_requests
    assert not engine_args_from(p.parse_args(base + ["--disable-log-requests"])).enable_log_requests
    assert not engine_args_from(p.parse_args(base + ["--no-enable-log-requests"])).enable_log_requests
    assert p.parse_args(base).uvicorn_log_level is None
    assert p.parse_args(base + ["--uvicorn-log-level", "warning"]).uvicorn_log_level == "warning"


def test_served_model_names():
    ns = build_parser().parse_args(["--model", str(TINY_MODEL), "--served-model-name", "a", "b"])
    a = engine_args_from(ns)
    assert a.model_name == "a" and a.model_names == ["a", "b"]
    assert EngineArgs(model=str(TINY_MODEL), served_model_name="x").model_names == ["x"]


# ---- --chat-template and --generation-config ----

def test_tool_launch_line_with_a_chat_template_file(tmp_path, monkeypatch):
    """The DeepSeek-V3.1 model card's vLLM line (the template file stands in for vLLM's)."""
    line = ("vllm serve ... --enable-auto-tool-choice --tool-call-parser deepseek_v31 "
            "--chat-template examples/tool_chat_template_deepseekv31.jinja")
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "tool_chat_template_deepseekv31.jinja").write_text("{{ 'T' }}")
    monkeypatch.chdir(tmp_path)
    ns = build_parser().parse_args(_argv(line))
    assert (ns.tool_call_parser, ns.enable_auto_tool_choice) == ("deepseek_v31", True)
    engine_args_from(_local(ns))
    from server.overrides import load_chat_template
    assert load_chat_template(ns.chat_template) == "{{ 'T' }}"


@pytest.mark.parametrize("argv,needle", [
    (["--chat-template", "/no/such/template.jinja"], "--chat-template: no such file"),
    (["--generation-config", "/no/such/dir"], "--generation-config: no generation_config.json"),
    (["--chat-template", "{% for m in messages %}{{ m.content }"], "--chat-template: not a valid Jinja template"),
    (["--seed", str(1 << 70)], "--seed must be in"),
    (["--cpu-kv-cache-gb", "0"], "--cpu-kv-cache-gb must be a positive number"),
    (["--cpu-kv-cache-gb", "nan"], "--cpu-kv-cache-gb must be a positive number"),
    (["--host", "bogus.invalid"], "--host bogus.invalid: cannot listen"),  # found binding: exit 1
])
def test_template_and_generation_config_errors_name_the_flag(argv, needle, capsys):
    from server.cli import main

    assert main([*argv, "--device", "cpu"]) == (1 if argv[0] == "--host" else 2)
    assert needle in capsys.readouterr().err


def test_response_role_and_default_chat_template_kwargs_flags(capsys):
    ns = build_parser().parse_args([str(TINY_MODEL), "--response-role", "bot",
                                    "--default-chat-template-kwargs", '{"thinking": true}'])
    engine_args_from(ns)
    assert (ns.response_role, ns.default_chat_template_kwargs) == ("bot", {"thinking": True})
    assert build_parser().parse_args([str(TINY_MODEL)]).response_role == "assistant"
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: tokenize cannot be set"):
        engine_args_from(build_parser().parse_args(
            [str(TINY_MODEL), "--default-chat-template-kwargs", '{"tokenize": true}']))
    for bad in ('["thinking"]', "{thinking}"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([str(TINY_MODEL), "--default-chat-template-kwargs", bad])
        assert "--default-chat-template-kwargs" in capsys.readouterr().err


def test_default_template_kwargs_are_checked_against_the_served_tokenizer(monkeypatch):
    from server.frontend_options import FrontendOptions

    class Tok:  # a tokenizer whose chat template call takes one more parameter than the base's
        special_tokens_map = {"eos_token": "</s>"}

        def apply_chat_template(self, conversation, tools=None, strict_roles=False, **kwargs):
            return ""
    opts = FrontendOptions(default_template_kwargs={"strict_roles": True})  # fine for the base class
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: strict_roles cannot be set"):
        opts.check_template_defaults(Tok())
    FrontendOptions(default_template_kwargs={"thinking": True}).check_template_defaults(Tok())
    # without defaults nothing is looked up (no transformers import at start-up)
    monkeypatch.setattr("server.frontend_options.reserved_template_kwargs",
                        lambda tokenizer=None: pytest.fail("looked up"))
    FrontendOptions().check_template_defaults(Tok())


def test_config_file_flags_under_the_command_line(tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: %s\nmax_model_len: 128\nserved-model-name: [a, b]\n"
                   "enable-log-requests: false\ntrust_remote_code: true\nhf_overrides: {x: 1}\n"
                   "api-key: null\n" % TINY_MODEL)
    ns = build_parser().parse_args(["--config", str(cfg), "--max-model-len", "64"])
    assert (ns.max_model_len, ns.served_model_name) == (64, ["a", "b"])  # the command line wins
    assert ns.enable_log_requests is False and ns.trust_remote_code and ns.api_key is None
    assert engine_args_from(ns).hf_overrides == {"x": 1}
    ns = build_parser().parse_args([f"--config={cfg}"])
    assert ns.max_model_len == 128 and ns.model == str(TINY_MODEL)
    cfg.write_text("served-model-name: [solo]\n")  # a list flag must not take the positional model
    ns = build_parser().parse_args([str(TINY_MODEL), "--config", str(cfg)])
    assert (ns.model_tag, ns.served_model_name) == (str(TINY_MODEL), ["solo"])
    for text, needle in (("nope: 1\n", "unsupported flag: --nope"), ("- a\n", "must be a mapping"),
                         ("a: [\n", "not valid YAML")):
        cfg.write_text(text)
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--config", str(cfg)])
        assert needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", str(tmp_path / "missing.yaml")])
    assert "--config" in capsys.readouterr().err


@pytest.mark.parametrize("words,want", [(["--enable-prefix-caching", "True"], True),
                                         (["--enable-prefix-caching", "false"], False),
                                         (["--enable-prefix-caching=FALSE"], False),
                                         (["--no-enable-prefix-caching", "--enable-prefix-caching=true"], True)])
def test_switches_take_older_vllms_explicit_value(words, want):
    """`--flag True|False` (older vLLM's form) sets the switch; the value is not the model."""
    ns = build_parser().parse_args([str(TINY_MODEL), *words, "--enable-chunked-prefill", "True"])
    assert ns.enable_prefix_caching is want and ns.model_tag == str(TINY_MODEL)
    assert engine_args_from(ns).enable_prefix_caching is want
    with pytest.raises(ValueError, match="--no-enable-chunked-prefill"):  # still refused when off
        engine_args_from(build_parser().parse_args([str(TINY_MODEL), "--enable-chunked-prefill", "false"]))


def test_config_file_list_for_a_one_value_flag(tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-model-len: [64, 128]\n")
    with pytest.raises(SystemExit):
        build_parser().parse_args([str(TINY_MODEL), "--config", str(cfg)])
    err = capsys.readouterr().err
    assert "max-model-len takes one value" in err and str(cfg) in err


def test_ssl_flags_are_checked(tmp_path):
    key = tmp_path / "k.pem"
    key.write_text("x")
    with pytest.raises(ValueError, match="--ssl-certfile .*: no such file"):
        engine_args_from(build_parser().parse_args([str(TINY_MODEL), "--ssl-keyfile", str(key),
                                                    "--ssl-certfile", str(tmp_path / "none.pem")]))
    with pytest.raises(ValueError, match="go together"):
        engine_args_from(build_parser().parse_args([str(TINY_MODEL), "--ssl-keyfile", str(key)]))
    # files that are not PEM are refused here, before the model loads, not by uvicorn later
    with pytest.raises(ValueError, match="--ssl-certfile .* not a PEM certificate and its private key"):
        engine_args_from(build_parser().parse_args([str(TINY_MODEL), "--ssl-keyfile", str(key),
                                                    "--ssl-certfile", str(key)]))
    for flags in (["--ssl-ca-certs", str(key)], ["--ssl-cert-reqs", "2"]):
        with pytest.raises(ValueError, match="needs HTTPS"):
            engine_args_from(build_parser().parse_args([str(TINY_MODEL), *flags]))
    with pytest.raises(ValueError, match="--ssl-cert-reqs 2 .* needs --ssl-ca-certs"):
        engine_args_from(build_parser().parse_args([str(TINY_MODEL), "--ssl-keyfile", str(key),
                                                    "--ssl-certfile", str(key), "--ssl-cert-reqs", "2"]))
    with pytest.raises(ValueError, match="--ssl-certfile .*: a directory, not a file"):
        engine_args_from(build_parser().parse_args([str(TINY_MODEL), "--ssl-keyfile", str(key),
                                                    "--ssl-certfile", str(tmp_path)]))


def _engine_args(line: str):
    return engine_args_from(build_parser().parse_args(["--model", str(TINY_MODEL), *line.split()]))


def test_vllm_engine_flags_cuda_graphs_and_quantization(tmp_path):
    from engine.cuda_graph import default_buckets
    # flags whose ask this server meets anyway, with any value where vLLM takes one
    _engine_args("--disable-custom-all-reduce --disable-cascade-attn --swap-space 16 --max-seq-len-to-capture 8192")
    assert _engine_args("").cuda_graph_sizes is None
    assert _engine_args("--long-prefill-token-threshold 2k").long_prefill_token_threshold == 2000
    assert _engine_args("").long_prefill_token_threshold == 0
    assert _engine_args("--cuda-graph-sizes 32").cuda_graph_sizes == (1, 2, 4, 8, 16, 24, 32)  # vLLM's pattern
    assert _engine_args("--cuda-graph-sizes 64 1 3 3").cuda_graph_sizes == (1, 3, 64)
    assert _engine_args("--max-cudagraph-capture-size 40").cuda_graph_sizes == (1, 2, 4, 8, 16, 32, 40)
    # the patterns stop at --max-num-seqs: a huge N builds nothing large
    assert _engine_args("--max-num-seqs 20 --cuda-graph-sizes 100000000000").cuda_graph_sizes == (1, 2, 4, 8, 16)
    assert _engine_args("--max-num-seqs 20 --max-cudagraph-capture-size 100000000000").cuda_graph_sizes == \
        (1, 2, 4, 8, 16, 20)
    for line, msg in (("--cuda-graph-sizes 0", "sizes must be >= 1"),
                      ("--cuda-graph-sizes 8 --max-cudagraph-capture-size 8", "give one of them"),
                      ("--max-cudagraph-capture-size 0", "must be >= 1"),
                      ("--max-num-seqs 16 --cuda-graph-sizes 64 128", "every size is above --max-num-seqs 16")):
        with pytest.raises(ValueError, match=msg):
            _engine_args(line)
    # the engine's side: sizes above max_num_seqs are left out; the default stops at 256
    assert default_buckets(16, (1, 3, 64)) == [1, 3]
    assert default_buckets(512)[-1] == 256 and default_buckets(20) == [1, 2, 4, 8, 16]
    # --quantization fp8: a bf16 checkpoint is quantized at load, an FP8 one read as it is, one
    # quantized another way refused
    assert _engine_args("--quantization fp8").quantization == "fp8"
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    (fp8 / "config.json").write_text('{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}')
    check_quantization("fp8", str(fp8))
    (fp8 / "config.json").write_text('{"quantization_config": {"quant_method": "awq", "bits": 4}}')
    with pytest.raises(ValueError, match="--quantization fp8: the checkpoint .* is quantized another way"):
        check_quantization("fp8", str(fp8))
    check_quantization(None, str(tmp_path / "missing"))  # nothing read without the flag
    (fp8 / "config.json").write_text('{"quantization_config": "fp8"}')
    with pytest.raises(ValueError, match="not a JSON object"):
        check_quantization("fp8", str(fp8))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "awq"])
