"""``deepinfer train-drafter --model M --out DIR``: train the learned drafter head (speculative
method ``"draft"``) for a Llama-family model on its own generations, no outside data.

1. The target writes user turns: its chat template up to the user's text, an opening word,
   then sampling (varied temperatures and seeds) until the turn ends.
2. It answers each one greedily (the engine, batched).
3. A teacher-forced dense float32 pass over every conversation records the pre-norm hidden
   state and the greedy next token at each position (:mod:`..models.llama.drafter_train`).
4. The head trains (AdamW) on the first conversations; the last ``--holdout`` share reports
   the acceptance by draft position, the mean accepted length and the confidence's expected
   calibration error. ``DIR`` gets ``config.json``, ``model.safetensors`` and ``training.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

_OPENERS = (
    "Explain", "Write", "How do I", "What is", "Can you", "Give me", "Why does", "List", "Describe",
    "Summarize", "Help me", "What are", "Tell me", "Compare", "Suggest", "I need", "Is it", "Create",
    "How can", "Which", "Fix", "Translate", "Plan", "Rewrite",
)  # fmt: skip
_SENTINEL = "\x00DRAFTER-USER-TEXT\x00"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train-drafter",
        help="train the learned drafter head (speculative method 'draft') on the model's own text",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model", required=True, help="a Llama-family model: path or installed alias")
    parser.add_argument("--out", required=True, help="directory for the head (created)")
    parser.add_argument("--prompts", type=int, default=256, help="conversations the model writes (default 256)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps (default 600)")
    parser.add_argument("--batch-size", type=int, default=128, help="chains per step (default 128)")
    parser.add_argument("--chain", type=int, default=4, help="draft steps trained per chain (default 4)")
    parser.add_argument(
        "--intermediate-size", type=int, default=None, help="the head's MLP width (default: the model's)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default 1e-3)")
    parser.add_argument("--max-prompt-tokens", type=int, default=48, help="user turn length cap (default 48)")
    parser.add_argument("--max-answer-tokens", type=int, default=160, help="answer length cap (default 160)")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (default 8192)")
    parser.add_argument("--holdout", type=float, default=0.1, help="share of conversations held out (default 0.1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests generated together (default 64)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--teacher",
        choices=("dense", "engine"),
        default="dense",
        help="where the hidden states and greedy tokens come from: the dense float32 model (default) or the "
        "engine's own forward (its weights as it serves them: on a CPU the packed low-bit ones, ~10x faster)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the model generates, the teacher pass runs and the head trains (cpu, cuda)",
    )
    parser.set_defaults(func=run)
    return parser


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def generate_conversations(llm, args) -> tuple[list[list[int]], list[int]]:
    """(token ids of each conversation, the first position after the system text in each)."""
    from ..chat_prompt import render_chat
    from ..engine.sampling_params import SamplingParams

    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError("train-drafter needs a model with a tokenizer and a chat template")
    rendered = render_chat(tok, [{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    if _SENTINEL not in rendered:
        raise ValueError("the model's chat template does not render the user's text")
    prefix = rendered.split(_SENTINEL)[0]
    rng = random.Random(args.seed)
    starters = [rng.choice(_OPENERS) for _ in range(args.prompts)]
    temps = [rng.choice((0.7, 0.9, 1.0, 1.1)) for _ in range(args.prompts)]
    t0 = time.time()
    params = [
        SamplingParams(temperature=t, seed=args.seed * 100003 + i, max_tokens=args.max_prompt_tokens)
        for i, t in enumerate(temps)
    ]
    outs = llm.generate([prefix + s for s in starters], params, use_tqdm=False)
    users = [(s + o.outputs[0].text).strip() for s, o in zip(starters, outs)]
    users = [u for u in users if len(u) > 8]
    _log(f"  {len(users)} user turns written in {time.time() - t0:.0f} s")
    t0 = time.time()
    answers = llm.chat(
        [[{"role": "user", "content": u}] for u in users],
        SamplingParams(temperature=0.0, max_tokens=args.max_answer_tokens),
        use_tqdm=False,
    )
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in answers]
    region = len(tok.encode(prefix, add_special_tokens=False))
    n = sum(len(o.outputs[0].token_ids) for o in answers)
    _log(f"  {len(seqs)} answers ({n} tokens) in {time.time() - t0:.0f} s")
    return seqs, [region] * len(seqs)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..engine import loading
    from ..engine.llm import LLM
    from ..models.llama.drafter import DraftHead, DraftHeadConfig, SharedTarget, load_head, save_head
    from ..models.llama.drafter_train import evaluate_head, teacher_data, top_tokens, train_head

    if not 0.0 < args.holdout < 1.0 or args.prompts < 2 or args.chain < 1 or args.steps < 1:
        print("deepinfer train-drafter: error: need --prompts >= 2, --steps >= 1, --chain >= 1, 0 < --holdout < 1",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.manual_seed(args.seed)
    t_start = time.time()
    _log(f"train-drafter: {args.model} -> {args.out}")
    _log("1/4 the model writes its conversations")
    device = torch.device(args.device)
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, seed=args.seed, device=args.device)
    if "embed_tokens" not in dict(llm.engine.model.model.named_children()):
        raise SystemExit("deepinfer train-drafter: error: the 'draft' head is for Llama-family models")
    seqs, regions = generate_conversations(llm, args)
    engine = llm.engine
    _, target, _, _, _ = loading.load(
        args.model, engine.host, engine.platform, device, torch.float32, requested_dtype="float32"
    )
    teacher = engine if args.teacher == "engine" else None
    del llm, engine
    if device.type == "cuda" and teacher is None:
        torch.cuda.empty_cache()
    if args.threads:  # the torch work from here on (the engine above keeps its own thread choice)
        torch.set_num_threads(args.threads)
    target.requires_grad_(False)
    split = max(1, int(round(len(seqs) * (1 - args.holdout))))
    kind = "the engine's own forward" if teacher is not None else "float32"
    _log(f"2/4 teacher pass ({kind}) over {len(seqs)} conversations ({split} train, {len(seqs) - split} held out)")
    train = teacher_data(target, seqs[:split], regions[:split], args.chain, _log, teacher)
    held = teacher_data(target, seqs[split:], regions[split:], args.chain, _log, teacher)
    del teacher
    eos = [int(e) for e in ([target.config.get("eos_token_id")] if isinstance(target.config.get("eos_token_id"), int)
                            else target.config.get("eos_token_id") or [])]  # fmt: skip
    vocab_ids, covered = top_tokens(train, args.draft_vocab, int(target.config["vocab_size"]), eos)
    _log(f"  draft vocabulary: {len(vocab_ids)} tokens cover {covered:.1%} of the training data's greedy tokens")
    name = os.path.basename(str(args.model))
    shape = dict(target.config, **({"intermediate_size": args.intermediate_size} if args.intermediate_size else {}))
    cfg = DraftHeadConfig.for_target(shape, len(vocab_ids), name, max(8, args.chain), args.chain)
    head = DraftHead(cfg)
    head.vocab_ids.copy_(vocab_ids)
    head.to(device)
    shared = SharedTarget(target, head.vocab_ids, torch.float32)
    _log(f"3/4 training: {args.steps} steps x {args.batch_size} chains of {args.chain}, "
         f"{sum(p.numel() for p in head.parameters()) / 1e6:.2f} M parameters")  # fmt: skip
    records = train_head(head, shared, train, args.steps, args.batch_size, args.lr, args.seed, _log)
    save_head(head, args.out)
    _log("4/4 held-out evaluation (the saved head, as loaded)")
    result = evaluate_head(load_head(args.out, device), shared, held)
    summary = {
        "model": args.model,
        "command": "deepinfer train-drafter " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["train-drafter"] else "",
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "conversations": {"train": split, "held_out": len(seqs) - split},
        "tokens": {"train": int(train.tokens.numel()), "held_out": int(held.tokens.numel())},
        "draft_vocab_coverage": covered,
        "held_out": result,
        "log": records,
        "wall_seconds": round(time.time() - t_start, 1),
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    acc = " ".join(f"{a:.3f}" for a in result["accept_by_position"])
    _log(f"held out: {result['chains']} chains; acceptance by position (given the earlier accepted) {acc}; "
         f"mean accepted {result['mean_accepted']:.3f} of {args.chain}; ECE {result['ece']:.4f}; "
         f"{summary['wall_seconds']:.0f} s in all")  # fmt: skip
    return 0
