"""lm-evaluation-harness against `ridge serve`, and against HF transformers on the same weights.

A multiple-choice task of generated questions (arithmetic, opposites, next in a sequence: answers a 0.5B model
gets partly right) runs twice: lm-eval's `local-completions` model against a ridge server (loglikelihoods from
echo + logprobs, the tokenizer read through /tokenizer_info and /tokenize), and lm-eval's `hf` model on HF
transformers' own model of the GGUF file (float32). The accuracies and each choice's loglikelihood are compared.

Needs lm_eval installed beside ridge (it is not a ridge dependency):
    python scripts/lm-eval-check.py --model qwen2.5-coder-0.5b [--questions 120]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("day", "night"), ("old", "young"),
             ("open", "closed"), ("light", "dark"), ("early", "late"), ("happy", "sad"), ("full", "empty"),
             ("hard", "soft"), ("rich", "poor"), ("wet", "dry"), ("left", "right"), ("win", "lose")]


def questions(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            a, b = rng.randint(2, 49), rng.randint(2, 49)
            answer = a + b
            wrong = rng.sample([answer + d for d in (-10, -2, -1, 1, 2, 10) if answer + d > 0], 3)
            rows.append({"question": f"{a} + {b} =", "choices": [str(x) for x in [answer, *wrong]]})
        elif kind == 1:
            word, opposite = rng.choice(OPPOSITES)
            others = rng.sample([w for pair in OPPOSITES for w in pair if w not in (word, opposite)], 3)
            rows.append({"question": f"The opposite of {word} is", "choices": [opposite, *others]})
        else:
            start, step = rng.randint(1, 20), rng.randint(2, 9)
            seq = [start + step * k for k in range(4)]
            answer = start + step * 4
            wrong = rng.sample([answer + d for d in (-3, -1, 1, 2, step) if answer + d > 0], 3)
            rows.append({"question": ", ".join(map(str, seq)) + ",", "choices": [str(x) for x in [answer, *wrong]]})
        order = list(range(4))
        rng.shuffle(order)
        rows[-1]["label"] = order.index(0)
        rows[-1]["choices"] = [rows[-1]["choices"][j] for j in order]
    return rows


TASK = """task: ridge_check
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
"""


def run_lm_eval(model: object, model_args: str, tasks: Path) -> dict:
    """One lm_eval run of the task: its accuracy and each question's choice loglikelihoods."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["ridge_check"], batch_size=8,
                                  task_manager=TaskManager(include_path=str(tasks)), log_samples=True)
    per_doc = {row["doc_id"]: [float(r[0]) for r in row["filtered_resps"]] for row in out["samples"]["ridge_check"]}
    return {"acc": out["results"]["ridge_check"]["acc,none"], "loglikelihoods": per_doc}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a ridge model name (pulled) or GGUF path")
    parser.add_argument("--questions", type=int, default=120)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    from ridge import hub

    gguf = Path(args.model) if Path(args.model).exists() else hub.pull(args.model)
    work = Path(tempfile.mkdtemp(prefix="ridge-lm-eval-"))
    data = work / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions(args.questions)))
    tasks = work / "tasks"
    tasks.mkdir()
    (tasks / "ridge_check.yaml").write_text(TASK.format(data=data))

    server = subprocess.Popen([sys.executable, "-m", "ridge.cli", "serve", "--model", str(gguf), "--dtype", "float32",
                               "--port", str(args.port), "--served-model-name", "ridge"])
    try:
        url = f"http://127.0.0.1:{args.port}"
        for _ in range(300):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        started = time.perf_counter()
        ridge = run_lm_eval("local-completions", f"model=ridge,base_url={url}/v1/completions,tokenizer_backend=remote,"
                            "num_concurrent=4,max_retries=1", tasks)
        ridge_s = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=60)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import weights_only_gguf  # transformers' GGUF loader, fed the weights without the vocabulary

    hf_dir = work / "hf"
    hf_dir.mkdir()
    copy = weights_only_gguf(gguf, hf_dir / gguf.name)
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, gguf_file=copy.name, dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    started = time.perf_counter()
    hf = run_lm_eval(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8), "", tasks)
    hf_s = time.perf_counter() - started

    gaps = [abs(a - b) for doc, lls in ridge["loglikelihoods"].items()
            for a, b in zip(lls, hf["loglikelihoods"][doc], strict=True)]
    same_choice = sum(max(range(4), key=lls.__getitem__) == max(range(4), key=hf["loglikelihoods"][doc].__getitem__)
                      for doc, lls in ridge["loglikelihoods"].items())
    print(json.dumps({"questions": args.questions, "ridge_acc": ridge["acc"], "hf_acc": hf["acc"],
                      "same_choice": same_choice, "max_loglikelihood_gap": max(gaps),
                      "mean_loglikelihood_gap": sum(gaps) / len(gaps), "ridge_s": round(ridge_s, 1),
                      "hf_s": round(hf_s, 1)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
