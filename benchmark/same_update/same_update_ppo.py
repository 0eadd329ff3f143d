"""One PPO update on identical inputs, ppo.py's lines against TRL 0.21's PPOTrainer: the same prompts (the first
update's of a seed), the same sampled completions and the same weights (policy, reference, reward model, critic);
each side then runs its own reward-model, policy, reference and critic passes, KL penalty, per-token rewards, GAE,
whitening, clipped policy and value losses and gradient. Prints how far apart every step is; a relative gradient
difference near 1e-5 is float32 rounding.

    python benchmark/same_update/same_update_ppo.py --seed 1   # SmolLM2-135M-Instruct (benchmark/.models, made by curves.py)

TRL 0.21 needs transformers 4.x: its side runs in benchmark/.venv-trl021 (synthetic/setup_trl021.sh), in a subprocess of this
script (--trl_side). Our side samples the completions, saves the perturbed policy, the reward model and the token ids
to --out, runs TRL's side, then computes its own update on TRL's micro-batches and compares.

Settings: 8 prompts x 1 completion, micro-batches of 4, two gradient-accumulation steps, one epoch of one mini-batch,
48 response tokens (so that some completions end with the EOS and are padded after it), temperature 0.7, fp32. The
policy is the initial weights plus Gaussian noise (--noise 0.02: each weight matrix moves by 2% of its own std), the
reference the initial weights, so that the KL penalty is not 0. The reward model is SmolLM2's trunk with a new score
head (N(0, 1 / (hidden + 1)), seeded); the critic starts from it on both sides (ppo.py's default with a reward model).

TRL's side is its real `train()` with two replacements: `batch_generation` hands back our completions and the scores
generate() would return with them (the policy's logits at the response positions over the generation config's
temperature, from one pass of TRL's `forward` instead of cached decoding steps); `optimizer.step` records the
gradients, and the rollout's tensors from train()'s frame, instead of stepping (with --num_ppo_epochs 2 it steps after
the first epoch, our side takes ppo.py's AdamW step, and the second epoch's ratios move away from 1: both clips act).
The rest is TRL's: truncation, reward-model and critic passes, missing-EOS penalty, KL, rewards, GAE, whitening,
losses and accelerate's backward.

Corresponding settings (ppo.py flag = PPOConfig field), with the TRL 0.21 lines (trl/trainer/ppo_trainer.py):
    --kl_coef 0.05 --kl_estimator k1 (or k3) = kl_coef=0.05, kl_estimator="k1" ("k3") (510-512; ppo.py's default
                                 --kl_estimator None is k1 in the reward; --kl_penalty reward is TRL's only place)
    --score_position after_eos = 504, 513-516: the score one token past the EOS (ppo.py's default: at the EOS)
    --whiten_rewards False     = whiten_rewards=False      (519-521)
    --gamma 1.0 --lam 0.95     = gamma=1.0, lam=0.95       (524-533; 534-535 advantages whitened over real tokens)
    --cliprange 0.2 --cliprange_value 0.2 --vf_coef 0.1 = the same fields (578-583, 564-577, 584)
    --missing_eos_penalty P    = missing_eos_penalty=P     (494-496; subtracted on both sides; off by default)
    --stop_token eos           = stop_token="eos"          (TRL's default None: no truncation)
    --response_length 48       = response_length=48        (TRL's default 53)
    --num_ppo_epochs 1 (or 2)  = num_ppo_epochs=1 (or 2)   (TRL's default 4)
    --num_mini_batches 1 --per_device_train_batch_size 4 --gradient_accumulation_steps 2: the same fields
    --reward_model_path RM     = reward_model=RM, value_model=RM (466-472: get_reward on both)
    --max_grad_norm 1e9        = TRL 0.21's PPO never clips (585-587: backward, then step; max_grad_norm unused)
    AdamW lr 5e-5, eps 1e-5    = learning_rate=5e-5, adam_epsilon=1e-5 (TRL's default 1e-8; ppo.py's fixed)
    off, with no TRL 0.21 counterpart: --kl_target, --target_kl, --ratio_threshold, --use_score_scaling, --score_clip,
    --critic_warmup_updates, --value_head_shared.
Differences that no flag removes:
  - TRL finds padding by comparing tokens with the pad id (trl/trainer/utils.py: forward 969-971, get_reward 924-937;
    ppo_trainer.py 464). SmolLM2 pads with its EOS, <|im_end|>, which every chat prompt holds twice: TRL would mask
    those prompt tokens out of every pass, and count the EOS as padding (the score read one token early, the EOS out
    of the loss). TRL's examples add a pad token; both sides here pad with <|endoftext|> (--pad_token), which no
    prompt or completion holds. ppo.py's masks come from lengths, not the pad id: its side is the same with either.
  - TRL divides the logits by temperature + 1e-7 (365, 450, 559), ppo.py by the temperature: 1.4e-7 relative.
  - TRL's rollout logprobs come from generate()'s scores (cached decoding, 427-440), ppo.py's from a forward pass
    after sampling; here both come from forward passes, so that rounding difference is not measured.
  - TRL orders the batch by np.random.permutation (540), ppo.py by torch.randperm; the losses are token means per
    micro-batch, so the gradient depends on which rows share one. Our side takes TRL's permutation.
  - transformers 4.57 reads this folder's config (transformers 5 writes the rope base under rope_parameters) with
    rope_theta 10000 instead of SmolLM2's 100000: another function. TRL's side sets rope_theta by hand.
  - Logged statistics only: TRL's entropy and approxkl average over padding too (592-594), ppo.py's over real tokens."""

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: the scripts, utils, infra, benchmark.harness
from benchmark import harness  # noqa: E402

os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1, help="picks the prompts, the sampling noise, the weight noise and head")
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--noise", type=float, default=0.02, help="the policy's distance from the reference (0: none)")
parser.add_argument("--kl_coef", type=float, default=0.05)
parser.add_argument("--kl_estimator", default="k1", choices=["k1", "k3"])
parser.add_argument("--missing_eos_penalty", type=float, default=None)
parser.add_argument("--num_ppo_epochs", type=int, default=1, help="> 1: the last epoch's gradient, after real steps")
parser.add_argument("--pad_token", default="<|endoftext|>", help="both sides' pad token (SmolLM2's own: <|im_end|>)")
parser.add_argument("--trl_python", default=harness.TRL021_PYTHON)
parser.add_argument("--out", default="/tmp/same_update_ppo", help="the weights and tensors the two sides exchange")
parser.add_argument("--trl_side", action="store_true", help="(internal) run TRL's side, in TRL 0.21's venv")
cli = parser.parse_args()
MODEL, PROMPTS, SEED, OUT = cli.model, os.path.join(REPO, "data", "prompts.jsonl"), cli.seed, cli.out
N, RESPONSE_LENGTH, TEMPERATURE, MICRO, GA, EPOCHS = 8, 48, 0.7, 4, 2, cli.num_ppo_epochs
CLIP, CLIP_V, VF_COEF, GAMMA, LAM, LR = 0.2, 0.2, 0.1, 1.0, 0.95, 5e-5
log = print

import torch  # noqa: E402


def trl_side():
    """TRL 0.21's PPOTrainer.train() for one update on our inputs; saves its rollout tensors and gradients."""
    import datasets
    import numpy as np
    import transformers
    import trl
    import trl.trainer.ppo_trainer as ppo_trainer
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast
    from trl import PPOConfig, PPOTrainer
    from trl.core import masked_mean
    from trl.trainer.utils import forward

    def load(cls, path):  # transformers 4.x ignores rope_parameters (written by transformers 5): the base set by hand
        config = AutoConfig.from_pretrained(path)
        config.rope_theta = config.rope_parameters["rope_theta"]
        return cls.from_pretrained(path, config=config, torch_dtype=torch.float32)

    inp = torch.load(os.path.join(OUT, "inputs.pt"))
    tokenizer = PreTrainedTokenizerFast(  # a tokenizer saved by transformers 5 is read from its tokenizer.json here
        tokenizer_file=os.path.join(MODEL, "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token=cli.pad_token,
        padding_side="left",
    )
    assert tokenizer.pad_token_id == inp["pad_token_id"] and tokenizer.eos_token_id == inp["stop_token_id"]
    dataset = datasets.Dataset.from_dict({"input_ids": inp["prompts"]})
    config = PPOConfig(
        output_dir=os.path.join(OUT, "trl"),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GA,
        num_mini_batches=1,
        num_ppo_epochs=EPOCHS,
        total_episodes=N,
        response_length=RESPONSE_LENGTH,
        temperature=TEMPERATURE,
        stop_token="eos",
        missing_eos_penalty=cli.missing_eos_penalty,
        kl_coef=cli.kl_coef,
        kl_estimator=cli.kl_estimator,
        whiten_rewards=False,
        gamma=GAMMA,
        lam=LAM,
        cliprange=CLIP,
        cliprange_value=CLIP_V,
        vf_coef=VF_COEF,
        learning_rate=LR,
        adam_epsilon=1e-5,
        num_sample_generations=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # PPOConfig's default None turns bf16 on
        seed=SEED,
        disable_tqdm=True,
    )
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=load(AutoModelForCausalLM, os.path.join(OUT, "policy")),
        ref_model=load(AutoModelForCausalLM, MODEL),
        reward_model=load(AutoModelForSequenceClassification, os.path.join(OUT, "rm")),
        value_model=load(AutoModelForSequenceClassification, os.path.join(OUT, "rm")),  # the critic from the RM
        train_dataset=dataset,
        eval_dataset=dataset,
    )
    policy = trainer.policy_model
    log(f"TRL {trl.__version__}, transformers {transformers.__version__}: {policy.dtype}, "
        f"{policy.config._attn_implementation}, rope_theta {policy.config.rope_theta}")  # fmt: skip
    # our prompts, in our order, padded by TRL's own collator (the dataloader would shuffle them)
    trainer.dataloader = [trainer.data_collator([{"input_ids": q} for q in inp["prompts"]])]

    def sampled(model, queries, batch_size, pad_token_id, generation_config):
        """batch_generation replaced: our completions, and the scores generate() would return with them"""
        assert torch.equal(queries, inp["queries"]), "TRL's padded prompts differ from ours"
        query_responses = torch.cat([queries, inp["responses"]], 1)
        logits = forward(model, query_responses, pad_token_id).logits[:, queries.shape[1] - 1 : -1]
        return query_responses, logits / generation_config.temperature  # TemperatureLogitsWarper; no top-k, top-p

    ppo_trainer.batch_generation = sampled
    out = {"losses": [], "b_inds": []}
    keep = "query_responses logprobs ref_logprobs values scores padding_mask padding_mask_p1 kl rewards advantages returns"

    class Done(Exception):
        pass

    def step():  # optimizer.step replaced: called after each micro-batch's backward, from train()'s own frame
        f = sys._getframe(1).f_locals
        mb_mask = ~f["padding_mask"][f["micro_batch_inds"]]
        pg_clipfrac = masked_mean((f["pg_losses2"] > f["pg_losses"]).float(), mb_mask)  # TRL's 589-591, before the step
        losses = [f["pg_loss"], f["vf_loss"], pg_clipfrac, f["vf_clipfrac"]]
        out["losses"].append([f["micro_batch_inds"].tolist()] + [x.item() for x in losses])
        if not trainer.accelerator.sync_gradients:
            return
        out["b_inds"].append(f["b_inds"].tolist())
        if len(out["b_inds"]) < EPOCHS:  # one mini-batch per epoch: step for real, on to the next epoch
            return real_step()
        # the last epoch's accumulated gradients, and the rollout's tensors; then stop
        out.update({k: f[k] for k in keep.split()})
        out["grads"] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        raise Done

    real_step, trainer.optimizer.step = trainer.optimizer.step, step
    np.random.seed(SEED)  # the micro-batch permutation (540), for a log that repeats
    try:
        trainer.train()
    except Done:
        pass
    torch.save(out, os.path.join(OUT, "trl.pt"))


if cli.trl_side:
    trl_side()
    sys.exit(0)

import copy  # noqa: E402

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # noqa: E402

from infra.data import Shuffled, left_pad, load_prompts, truncate_response  # noqa: E402
from infra.decode import generate  # noqa: E402
from infra.models import load_pretrained, load_tokenizer  # noqa: E402
from infra.rewards import rm_scores  # noqa: E402
from ppo import compute_gae, place_scores, value_loss  # noqa: E402  (ppo.py's own functions; its main is guarded)
from utils import (  # noqa: E402
    INVALID_LOGPROB,
    PolicyAndValue,
    forward,
    init_value_head,
    kl_estimate,
    logprobs_from_logits,
    masked_mean,
    masked_whiten,
)

# ------------------------------------------------------------------------------------------------------------------
# 1. tokenizer, the first update's prompts and sampling noise as ppo.py draws them (infra.data.draw_prompts with k = 1)
tokenizer = load_tokenizer(MODEL)
tokenizer.pad_token = cli.pad_token  # see the docstring: TRL needs a pad token that is neither the EOS nor in a prompt
stop_token_id, pad = tokenizer.eos_token_id, tokenizer.pad_token_id  # ppo.py: --stop_token eos
queries_all, prompt_texts, _, _ = load_prompts(
    dataset_name=PROMPTS, split="train", prompt_field="prompt", tokenizer=tokenizer, max_prompt_length=128
)
data = Shuffled(len(queries_all), SEED)
idx = data.take(N)
uniforms = torch.rand((N, 1, RESPONSE_LENGTH), generator=data.rng).reshape(-1, RESPONSE_LENGTH)
prompts = [queries_all[i] for i in idx]
queries, query_mask = left_pad(prompts, pad)
context_length = queries.shape[1]
log("prompt rows", idx, "token lengths", [len(q) for q in prompts], "pad", pad, "eos", stop_token_id)

# 2. policy (perturbed), reference, reward model (a new seeded head); the critic a copy of the reward model
policy = load_pretrained(AutoModelForCausalLM, MODEL)
ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
noise_rng = torch.Generator().manual_seed(SEED)
with torch.no_grad():  # the weight matrices and the embedding, not the norms
    for p in policy.parameters():
        if p.dim() > 1:
            p.add_(cli.noise * p.std() * torch.randn(p.shape, generator=noise_rng))
rm = load_pretrained(AutoModelForSequenceClassification, MODEL, num_labels=1)
init_value_head(rm.score, (rm.config.hidden_size + 1) ** -0.5, SEED)
os.makedirs(OUT, exist_ok=True)
policy.save_pretrained(os.path.join(OUT, "policy"), safe_serialization=True)
rm.save_pretrained(os.path.join(OUT, "rm"), safe_serialization=True)
rm.eval().requires_grad_(False)
critic = copy.deepcopy(rm).requires_grad_(True)  # ppo.py: the critic starts from the reward model
model = PolicyAndValue(policy, critic).eval()
log(f"ours: transformers {transformers.__version__}, {policy.dtype}, {policy.config._attn_implementation}, noise {cli.noise}")

# ------------------------------------------------------------------------------------------------------------------
# 3. OUR rollout: ppo.py's steps 1-4, one chunk (local_rollout_forward_batch_size 64 >= 8)
with torch.no_grad():
    response = generate(
        model=policy,
        queries=queries,
        query_mask=query_mask,
        response_length=RESPONSE_LENGTH,
        rule=TEMPERATURE,
        stop_token_id=stop_token_id,
        uniforms=uniforms,
    )
    assert not (response == pad).any() or pad == stop_token_id, "a completion holds the pad token; try another seed"
    responses, lengths = truncate_response(response, stop_token_id, pad)
    width = responses.shape[1]
    padding_mask = torch.arange(width)[None, :] >= lengths[:, None]  # True on padding
    query_responses = torch.cat([queries, responses], 1)
    attention_mask = torch.cat([query_mask, (~padding_mask).long()], 1)
    logits, value = model(query_responses, attention_mask, logits_to_keep=width + 1)
    logprobs = logprobs_from_logits(logits[:, :-1], responses, TEMPERATURE).masked_fill(padding_mask, INVALID_LOGPROB)
    values = value[:, context_length - 1 :][:, :width]
    ref_logits = forward(ref_policy, query_responses, attention_mask, logits_to_keep=width + 1).logits[:, :-1]
    ref_logprobs = logprobs_from_logits(ref_logits, responses, TEMPERATURE).masked_fill(padding_mask, INVALID_LOGPROB)
    del logits, ref_logits
    scores = rm_scores(
        rm,
        rm_tokenizer=None,
        tokenizer=tokenizer,
        query_responses=query_responses,
        mask=attention_mask,
        context_length=context_length,
        lengths=lengths,
        stop_token_id=stop_token_id,
    )
    contain_eos = (responses == stop_token_id).any(1)
    if cli.missing_eos_penalty is not None:
        scores = scores - cli.missing_eos_penalty * (~contain_eos).float()

    # 3. KL penalty in each token's reward, the score one token past the EOS (--score_position after_eos)
    kl = kl_estimate(logprobs, ref_logprobs, cli.kl_estimator).masked_fill(padding_mask, 0.0)
    non_score_reward = -cli.kl_coef * kl
    rewards, value_mask = place_scores(non_score_reward, scores, lengths, "after_eos")
    train_mask = ~padding_mask  # every completion scored

    # 4. advantages: GAE over real tokens, then whitened
    values = values.masked_fill(~value_mask, 0.0)
    advantages, returns = compute_gae(rewards, values, GAMMA, LAM)
    advantages = masked_whiten(advantages, train_mask).masked_fill(~train_mask, 0.0)
log("completion lengths", lengths.tolist(), "width", width, "with EOS", contain_eos.tolist())
log("scores", [round(s, 3) for s in scores.tolist()])
log("KL per completion", [round(x, 3) for x in kl.sum(1).tolist()])

# ------------------------------------------------------------------------------------------------------------------
# 5. TRL's side, in its own venv, on the same prompts and completions
torch.save(
    {"prompts": prompts, "queries": queries, "responses": responses, "pad_token_id": pad, "stop_token_id": stop_token_id},
    os.path.join(OUT, "inputs.pt"),
)
args = [f"--{k}={v}" for k, v in vars(cli).items() if v is not None and k not in ("trl_side", "trl_python")]
subprocess.run([cli.trl_python, os.path.abspath(__file__), "--trl_side", *args], check=True)
trl = torch.load(os.path.join(OUT, "trl.pt"))
log("TRL done; its micro-batches", [mb[0] for mb in trl["losses"]])
model.zero_grad(set_to_none=True)

# 6. OUR gradient: ppo.py's update lines, on the micro-batches TRL's permutations made (one per epoch); ppo.py's
# optimiser, without clipping (--max_grad_norm 1e9), steps between epochs
model.train(False)  # ppo.py: model.train(args.gradient_checkpointing)
optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-5, weight_decay=0.0, fused=True)
our_losses = []
for epoch, start in [(e, s) for e in range(EPOCHS) for s in range(0, N, MICRO)]:
    if epoch > 0 and start == 0:
        optimizer.step()
        optimizer.zero_grad()
    micro_inds = torch.as_tensor(trl["b_inds"][epoch][start : start + MICRO])
    mb_mask, mb_value_mask = train_mask[micro_inds], value_mask[micro_inds]
    logits, vpred = model(query_responses[micro_inds], attention_mask[micro_inds], width + 1)
    logits = logits[:, :-1]
    vpred = vpred[:, context_length - 1 : -1].masked_fill(~mb_value_mask, 0.0)
    new_logprobs = logprobs_from_logits(logits, responses[micro_inds], TEMPERATURE).masked_fill(~mb_mask, INVALID_LOGPROB)
    logprobs_diff = new_logprobs - logprobs[micro_inds]
    ratio = torch.exp(logprobs_diff)
    mb_advantage = advantages[micro_inds]
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - CLIP, 1.0 + CLIP)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), mb_mask)
    vf_loss, vf_clipfrac = value_loss(
        vpred, values=values[micro_inds], returns=returns[micro_inds], mask=mb_value_mask, cliprange_value=CLIP_V
    )
    loss = pg_loss + VF_COEF * vf_loss
    (loss / GA).backward()  # accelerator.backward divides by gradient_accumulation_steps
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses).float(), mb_mask)
    our_losses.append([micro_inds.tolist(), pg_loss.item(), vf_loss.item(), pg_clipfrac.item(), vf_clipfrac.item()])
g_ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

# ------------------------------------------------------------------------------------------------------------------
# 7. comparison
print()


def diff(name, ours, theirs, where=None):
    """max |ours - TRL| (over `where`), and the relative norm of the difference"""
    ours, theirs = ours.double(), theirs.double()
    if where is not None:
        ours, theirs = ours[where], theirs[where]
    d = (ours - theirs).abs()
    rel = (d.norm() / theirs.norm()).item() if theirs.norm() > 0 else float("nan")
    print(f"{name:34s} max |diff| {d.max().item():.3e}  rel {rel:.3e}  (|TRL| max {theirs.abs().max().item():.3f})")


real = ~padding_mask
print(f"tokens: {int(real.sum())} over {N} completions, width {width}; noise {cli.noise}; pad {pad}")
print("TRL's queries and query_responses equal ours:", torch.equal(trl["query_responses"], query_responses))
print("padding masks equal (TRL padding_mask, ~padding_mask_p1):", torch.equal(trl["padding_mask"], padding_mask),
      torch.equal(~trl["padding_mask_p1"], value_mask))  # fmt: skip
diff("rollout logprobs (real tokens)", logprobs, trl["logprobs"], real)
diff("reference logprobs (real tokens)", ref_logprobs, trl["ref_logprobs"], real)
diff("scores", scores, trl["scores"])
diff("KL per token (real tokens)", kl, trl["kl"], real)
diff("KL per completion", kl.sum(1), (trl["kl"] * real).sum(1))
diff("values (value_mask)", values, trl["values"], value_mask)
diff("rewards (all)", rewards, trl["rewards"])
diff("advantages, whitened (all)", advantages, trl["advantages"])
diff("returns (all)", returns, trl["returns"])
print(f"KL per completion mean {kl.sum(1).mean().item():.4f}, penalty {cli.kl_coef * kl.sum(1).mean().item():.4f}; "
      f"scores std {scores.std().item():.4f}; advantages |max| {advantages.abs().max().item():.3f}")  # fmt: skip
for (inds, *o), (inds_t, *t) in zip(our_losses, trl["losses"]):
    assert inds == inds_t
    print(f"micro-batch {inds}: pg_loss ours {o[0]:.7e} TRL {t[0]:.7e} | vf_loss ours {o[1]:.7e} TRL {t[1]:.7e} | "
          f"clipfrac pg {o[2]:.4f} {t[2]:.4f}, vf {o[3]:.4f} {t[3]:.4f}")  # fmt: skip
g_trl = {n.replace("value_model.", "critic.", 1): g for n, g in trl["grads"].items()}
harness.gradient_report(g_ours, g_trl, parts=("policy.", "critic.", ""))
