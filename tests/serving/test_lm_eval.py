"""lm-evaluation-harness, a real OpenAI-API client, against `myvllm serve` with the bundled model.

One server (the bundled SmolLM2 GGUF, float32 on the CPU) and two lm-eval runs at once, each the
command a user types (docs/serving.md, "lm-evaluation-harness"), on tasks this test writes to
tmp_path (a task YAML and a jsonl dataset each; no hub, no network):

- `local-completions`, batch size 4, on a multiple-choice task: lm-eval scores every choice
  with one loglikelihood request (a batch of token-id prompts, `echo`, `logprobs: 1`,
  `max_tokens: 1`). Oracle: each per-choice loglikelihood it records equals the sum of the
  continuation tokens' log-softmax of transformers' own model of the same GGUF (fp32) within
  1e-3, and its is-greedy flag equals transformers' argmax.
- `local-chat-completions` (num_concurrent 4: lm-eval sends chat requests one prompt each, so
  batch size 4 is concurrency here) on a generation task: every answer equals transformers'
  greedy continuation of the chat template's prompt, cut at the task's stop string.

The tokenizer lm-eval counts and splits tokens with comes from `myvllm export-tokenizer`; a test
checks that it encodes as the engine's own (test_cli.py checks a checkpoint's export so).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cli import check_tokenizer_folder, free_port, serve_subprocess

pytestmark = pytest.mark.slow

MODEL_NAME = "smollm2"
# (question, choices, index of the right one); lm-eval puts a space between question and choice.
MULTIPLE_CHOICE = [
    ("What is the capital of France?", ["Paris", "London", "Berlin"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four"], 1),
    ("Which planet is closest to the sun?", ["Venus", "Mars", "Mercury"], 2),
    ("What colour is the sky on a clear day?", ["blue", "green"], 0),
    ("What do bees make?", ["milk", "honey", "silk"], 1),
    ("At how many degrees Celsius does water freeze?", ["zero", "one hundred"], 0),
]
GENERATION = ["What is the capital of France?", "Name a primary colour.", "What is 2 plus 2?",
              "Say hello."]
STOP = "\n\n"
MAX_GEN_TOKENS = 12
# Loading the bundled GGUF (a parse, then dequantizing every tensor) beside the tokenizer export
# takes minutes on a busy 2-core machine; the lm-eval runs, each its import and a few requests.
STARTUP_TIMEOUT_S = 900
RUN_TIMEOUT_S = 900

MULTIPLE_CHOICE_TASK = """\
task: myvllm_multiple_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GENERATION_TASK = """\
task: myvllm_generation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: ""
generation_kwargs:
  until: [{stop}]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder: Path) -> None:
    """Both tasks' YAML and jsonl in folder, for lm-eval's --include_path."""
    folder.mkdir()
    (folder / "multiple_choice.jsonl").write_text("".join(
        json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
        for q, c, a in MULTIPLE_CHOICE))
    (folder / "multiple_choice.yaml").write_text(
        MULTIPLE_CHOICE_TASK.format(data=folder / "multiple_choice.jsonl"))
    (folder / "generation.jsonl").write_text("".join(
        json.dumps({"question": q}) + "\n" for q in GENERATION))
    (folder / "generation.yaml").write_text(GENERATION_TASK.format(
        data=folder / "generation.jsonl", stop=json.dumps(STOP), max_gen_toks=MAX_GEN_TOKENS))


def lm_eval_command(model: str, model_args: str, task: str, tasks: Path, out: Path,
                    *extra: str) -> list[str]:
    return [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
            "--tasks", task, "--include_path", str(tasks), "--batch_size", "4",
            "--log_samples", "--output_path", str(out), *extra]


def samples_of(out: Path, task: str) -> list[dict[str, Any]]:
    """The per-document records of lm-eval's --log_samples, in document order."""
    (path,) = out.glob(f"**/samples_{task}_*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(records, key=lambda r: r["doc_id"])


@pytest.fixture(scope="module")
def lm_eval_samples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both lm-eval runs against one `myvllm serve`: their samples, and the tokenizer folder."""
    from myvllm.utils.model_path import bundled_model_path

    root = tmp_path_factory.mktemp("lm_eval")
    tasks, tokenizer = root / "tasks", root / "tokenizer"
    write_tasks(tasks)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(root / "hf_home"), TOKENIZERS_PARALLELISM="false")
    model = bundled_model_path()
    port = free_port()
    with pytest.MonkeyPatch.context() as patch:
        for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HOME"):
            patch.setenv(key, env[key])  # the server inherits them
        # The tokenizer is written while the server loads (both parse the GGUF).
        export = subprocess.Popen(
            [sys.executable, "-m", "myvllm.entrypoints.cli", "export-tokenizer", model,
             str(tokenizer)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with serve_subprocess([model, "--served-model-name", MODEL_NAME, "--dtype", "float32",
                               "--device", "cpu", "--max-model-length", "512",
                               "--num-kvcache-blocks", "64"], port,
                              startup_timeout_s=STARTUP_TIMEOUT_S):
            assert export.wait() == 0, export.communicate()[0][-3000:]
            base = f"http://127.0.0.1:{port}/v1"
            runs = [
                lm_eval_command(
                    "local-completions",
                    f"base_url={base}/completions,model={MODEL_NAME},"
                    f"tokenizer_backend=huggingface,tokenizer={tokenizer}",
                    "myvllm_multiple_choice", tasks, root / "out_completions"),
                lm_eval_command(
                    "local-chat-completions",
                    f"base_url={base}/chat/completions,model={MODEL_NAME},num_concurrent=4",
                    "myvllm_generation", tasks, root / "out_chat", "--apply_chat_template"),
            ]
            procs = [subprocess.Popen(run, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for run in runs]
            for proc in procs:
                output = proc.communicate(timeout=RUN_TIMEOUT_S)[0]
                assert proc.returncode == 0, output[-5000:]
    return {"multiple_choice": samples_of(root / "out_completions", "myvllm_multiple_choice"),
            "generation": samples_of(root / "out_chat", "myvllm_generation"),
            "tokenizer": str(tokenizer), "model": model}


@pytest.fixture(scope="module")
def transformers_model(lm_eval_samples: dict[str, Any]) -> tuple[Any, Any]:
    """transformers' own model of the bundled GGUF (fp32) and the exported tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(lm_eval_samples["model"])
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 attn_implementation="eager").eval()
    assert next(model.parameters()).dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(lm_eval_samples["tokenizer"],
                                              local_files_only=True)
    return model, tokenizer


def lm_eval_split(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], int]:
    """The tokens lm-eval sends for (context, continuation) and where the continuation starts:
    the context's trailing spaces move to the continuation, the whole text is encoded once (no
    special tokens) and split after the context's own tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    return whole, len(tokenizer(context, add_special_tokens=False).input_ids)


@torch.no_grad()
def reference_loglikelihoods(model: Any, tokenizer: Any,
                             pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """Per (context, continuation): log P(continuation | context) and whether every continuation
    token is the argmax. One forward for all: the sequences are padded on the right, which
    a causal model's earlier positions never see."""
    split = [lm_eval_split(tokenizer, context, continuation) for context, continuation in pairs]
    longest = max(len(tokens) for tokens, _ in split)
    batch = torch.tensor([tokens + [0] * (longest - len(tokens)) for tokens, _ in split])
    logprobs = model(batch).logits.log_softmax(-1)
    found = []
    for row, (tokens, start) in zip(logprobs, split):
        positions = torch.arange(start, len(tokens))
        targets = torch.tensor(tokens[start:])
        picked = row[positions - 1, targets]
        greedy = bool((row[positions - 1].argmax(-1) == targets).all())
        found.append((float(picked.double().sum()), greedy))
    return found


@torch.no_grad()
def reference_chat_answer(model: Any, tokenizer: Any, question: str) -> str:
    """transformers' greedy answer to question through the chat template (as the server
    renders it), up to eos or MAX_GEN_TOKENS, cut at the stop string."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=MAX_GEN_TOKENS, do_sample=False,
                               eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.eos_token_id)
    answer = generated[0, prompt.shape[1]:].tolist()
    if tokenizer.eos_token_id in answer:
        answer = answer[:answer.index(tokenizer.eos_token_id)]
    return tokenizer.decode(answer, skip_special_tokens=True).split(STOP)[0]


def test_the_exported_tokenizer_encodes_as_the_engine(lm_eval_samples: dict[str, Any]) -> None:
    """`myvllm export-tokenizer` of the bundled GGUF (run by the fixture, as a user runs it)
    wrote a tokenizer that loads offline and encodes, ends and chats as the engine's own."""
    check_tokenizer_folder(lm_eval_samples["model"], Path(lm_eval_samples["tokenizer"]))


def test_local_completions_loglikelihoods_equal_transformers(
        lm_eval_samples: dict[str, Any], transformers_model: tuple[Any, Any]) -> None:
    model, tokenizer = transformers_model
    samples = lm_eval_samples["multiple_choice"]
    assert [s["doc"]["question"] for s in samples] == [q for q, _, _ in MULTIPLE_CHOICE]
    pairs, recorded = [], []
    for sample, (question, choices, _) in zip(samples, MULTIPLE_CHOICE):
        arguments = list(sample["arguments"].values())
        assert len(sample["resps"]) == len(arguments) == len(choices), sample
        for argument, response, choice in zip(arguments, sample["resps"], choices):
            assert argument["arg_1"] == " " + choice
            pairs.append((argument["arg_0"], argument["arg_1"]))
            # lm-eval logs (loglikelihood, is_greedy), each as a string.
            recorded.append((float(response[0][0]), response[0][1] == "True"))
    wanted = reference_loglikelihoods(model, tokenizer, pairs)
    for (context, continuation), (got, got_greedy), (want, want_greedy) in zip(
            pairs, recorded, wanted):
        print(f"{context!r} {continuation!r}: lm-eval {got:.6f}, transformers {want:.6f}")
        assert got == pytest.approx(want, abs=1e-3), (context, continuation)
        assert got_greedy == want_greedy, (context, continuation)


def test_local_chat_completions_answers_equal_transformers_greedy(
        lm_eval_samples: dict[str, Any], transformers_model: tuple[Any, Any]) -> None:
    model, tokenizer = transformers_model
    samples = lm_eval_samples["generation"]
    assert [s["doc"]["question"] for s in samples] == GENERATION
    for sample, question in zip(samples, GENERATION):
        (messages,) = sample["arguments"]["gen_args_0"]["arg_0"]
        assert json.loads(messages) == [{"role": "user", "content": question}]
        (answer,) = sample["resps"][0]
        want = reference_chat_answer(model, tokenizer, question)
        print(f"{question!r}: lm-eval {answer!r}, transformers {want!r}")
        assert answer and answer == want, question
