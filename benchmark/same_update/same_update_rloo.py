"""One RLOO update on identical inputs, rloo.py's lines against TRL 1.16's RLOOTrainer: the same prompts (the first
update's of a seed), the same sampled completions and the same weights; each side then scores the completions with
the same reward function, computes its own KL penalty from its own logprob passes of the policy and the reference,
its own leave-one-out advantages, loss and gradient. Prints how far apart every step is; a relative gradient
difference near 1e-5 is float32 rounding.

    python benchmark/same_update/same_update_rloo.py --seed 1   # SmolLM2-135M-Instruct (benchmark/.models, made by curves.py)

The settings are those of `curves.py rloo --task sentiment` (rloo.py --rloo_k 4 against RLOOConfig(beta=0.05)):
4 prompts x 4 completions, micro-batches of 8 (two whole prompts each), two gradient-accumulation steps, 24 response
tokens, temperature 0.7, clip 0.2, fp32. At a run's first update the policy is its reference and the KL penalty is
exactly 0 on both sides, so the policy here is the initial weights plus Gaussian noise (--noise 0.02: each weight
matrix moves by 2% of its own std, the same draw on both sides) and the reference the initial weights: every
completion then carries a KL penalty of a few nats, which moves the advantages.

Our side imports rloo.py's own `rloo_advantages` and repeats the lines of its rollout (steps 1-4) and update between
them. TRL's side runs its real `_generate_and_score_completions` with only the sampler replaced
(`_generate_single_turn` hands back our completions' token ids): its tokenization of the prompts, its decoding,
the reward function through `_calculate_rewards`, its policy and reference logprob passes (its own reference model,
loaded from the folder), the KL penalty, the leave-one-out baselines and the normalisation. Its output is split into
the same two micro-batches, which `_prepare_inputs` hands to its real `training_step` (compute_loss, the Trainer's
loss scaling and accelerator.backward).

Corresponding settings (rloo.py flag = RLOOConfig field), with the TRL 1.16 lines (trl/trainer/rloo_trainer.py):
    --rloo_k 4                = num_generations=4
    --kl_coef 0.05            = beta=0.05        (1673: rewards = rewards - self.beta * kl)
    --kl_estimator k1         = (TRL has only k1: 1669 per_token_kl = old_per_token_logps - ref_per_token_logps,
                                 summed over the completion, 1671); k2, k3, abs and full have no TRL counterpart
    rloo_advantages           = 1688-1690: each reward minus the mean of its scorable siblings' (unscorable: 0, 1699)
    --cliprange 0.2           = epsilon=0.2, epsilon_high=None (1829); rloo.py's --epsilon_high is TRL's (not run here)
    sequence-level ratio      = TRL's only one (1822-1824: logps summed over the completion, then the log ratio)
    mean over the micro-batch = 1833 per_sequence_loss.mean(), divided by gradient_accumulation_steps by the Trainer
    --normalize_advantage     = normalize_advantages=True (1696), but not exactly, see below; off by default, both
    --normalize_advantages    = normalize_advantages=True exactly: rloo.py's flag of TRL's name and form
    --score_clip C            = reward_clip_range=(-C, C) (1661; not exercised: sentiment scores lie in [-1, 1])
    no --ratio_threshold, --missing_eos_penalty, --use_score_scaling (ours), off here; rloo.py's
    --mask_truncated_completions and --reward_clip_range are TRL's (not run here). rloo.py takes TRL's names too
    (--num_generations, --beta, --epsilon, --num_iterations), which set the flags above.
Differences that no flag removes:
  - --normalize_advantage divides by std + 1e-8, TRL by nanstd + 1e-4 (1696: `(advantages - nanmean) /
    (nanstd(advantages) + 1e-4)`; both stds Bessel-corrected): the normalised advantages differ by a factor
    (std + 1e-8) / (std + 1e-4), 1e-4 / std relative (shown with --normalize_advantage). With several processes the
    statistics differ too: TRL's are over the global batch (the rewards are gathered in _calculate_rewards, 1246,
    and the advantages sliced after, 1704), rloo.py's over each process's own completions.
  - the old logprobs come from each side's own forward pass (ours grouped by prompt over the whole batch, TRL's in
    chunks of per_device_train_batch_size), so the on-policy ratio is 1 up to float32 rounding on each side.

The loss values say little here: on policy the ratio is 1, and a micro-batch of whole prompts holds each prompt's k
leave-one-out advantages, which sum to 0 (sum_i r_i - (S - r_i) / (k - 1) = 0), so both losses are -mean(A) = 0 up to
float32 rounding (about 1e-8). Their gradients, -mean(A * grad log p(completion)), are not: the gradients, the
advantages and the KL penalties are the comparison."""

import argparse
import copy
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: the scripts, utils, infra, benchmark.harness
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from benchmark import harness  # noqa: E402
from infra.data import Shuffled, left_pad, load_prompts, truncate_response  # noqa: E402
from infra.decode import generate  # noqa: E402
from infra.models import load_pretrained, load_tokenizer  # noqa: E402
from infra.rewards import sentiment_reward  # noqa: E402
from rloo import rloo_advantages  # noqa: E402  (rloo.py's own function; its main is guarded)
from utils import (  # noqa: E402
    INVALID_LOGPROB,
    forward_grouped,
    kl_estimate,
    logprobs_from_logits,
    masked_whiten,
)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1, help="picks the prompts, the sampling noise and the weight noise")
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--kl_coef", type=float, default=0.05, help="rloo.py's --kl_coef, TRL's beta")
parser.add_argument("--noise", type=float, default=0.02, help="the policy's distance from the reference (0: none)")
parser.add_argument("--normalize_advantage", action="store_true", help="ours and TRL's normalize_advantages")
parser.add_argument("--normalize_advantages", action="store_true", help="rloo.py's TRL form and TRL's")
parser.add_argument("--out", default="/tmp/same_update_rloo", help="TRL's output_dir (nothing is saved there)")
cli = parser.parse_args()
MODEL, PROMPTS, SEED = cli.model, os.path.join(REPO, "data", "prompts.jsonl"), cli.seed
K, N_PROMPTS, RESPONSE_LENGTH, TEMPERATURE, MICRO, GA, CLIP = 4, 4, 24, 0.7, 8, 2, 0.2
log = print


def reward(prompts, completions, **columns):
    """The project's sentiment reward as TRL calls it (benchmark/curves/trl_real.py): chat completions are message lists"""
    return sentiment_reward(prompts, [c[-1]["content"] if isinstance(c, list) else c for c in completions])


reward.__name__ = "sentiment"

# ------------------------------------------------------------------------------------------------------------------
# 1. model, reference, tokenizer, one batch as rloo.py's first update draws it
tokenizer = load_tokenizer(MODEL)
stop_token_id = tokenizer.eos_token_id  # rloo.py: --stop_token eos, no --stop_token_id
queries_all, prompt_texts, _, columns = load_prompts(
    dataset_name=PROMPTS, split="train", prompt_field="prompt", tokenizer=tokenizer, max_prompt_length=128
)
policy = load_pretrained(AutoModelForCausalLM, MODEL)
ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)  # rloo.py: the frozen initial policy
noise_rng = torch.Generator().manual_seed(SEED)
with torch.no_grad():  # the policy some way from its reference: the weight matrices and the embedding, not the norms
    for p in policy.parameters():
        if p.dim() > 1:
            p.add_(cli.noise * p.std() * torch.randn(p.shape, generator=noise_rng))
policy.eval()
w_ours = {n: p.detach().clone() for n, p in policy.named_parameters()}
w_ref = {n: p.detach().clone() for n, p in ref_policy.named_parameters()}
log("ours loaded:", policy.dtype, policy.config._attn_implementation, "noise", cli.noise)

data = Shuffled(len(queries_all), SEED)  # rloo.py's prompt stream and sampling noise, first update
idx = data.take(N_PROMPTS)
uniforms = torch.rand((N_PROMPTS, K, RESPONSE_LENGTH), generator=data.rng).reshape(-1, RESPONSE_LENGTH)
prompt_lengths = [len(queries_all[i]) for i in idx]
log("prompt rows", idx, "token lengths", prompt_lengths)
queries, query_mask = left_pad([queries_all[i] for i in idx], tokenizer.pad_token_id)
queries = queries.repeat_interleave(K, 0)
query_mask = query_mask.repeat_interleave(K, 0)
texts = [prompt_texts[i] for i in idx for _ in range(K)]
context_length = queries.shape[1]
rollout_group = K  # local_rollout_forward_batch_size 64 % 4 == 0: the whole batch is one chunk

# ------------------------------------------------------------------------------------------------------------------
# 2. OUR rollout: rloo.py's steps 1-4 (no score transforms, no missing-EOS penalty, on the CPU without autocast)
with torch.no_grad():
    response = generate(
        model=policy,
        queries=queries,
        query_mask=query_mask,
        response_length=RESPONSE_LENGTH,
        rule=TEMPERATURE,
        stop_token_id=stop_token_id,
        uniforms=uniforms,
        group=rollout_group,
    )
    responses, lengths = truncate_response(response, stop_token_id, tokenizer.pad_token_id)
    width = responses.shape[1]
    padding_mask = torch.arange(width)[None, :] >= lengths[:, None]
    query_responses = torch.cat([queries, responses], 1)
    attention_mask = torch.cat([query_mask, (~padding_mask).long()], 1)
    logits = forward_grouped(
        policy, query_responses, attention_mask, context_length=context_length, group=rollout_group, logits_to_keep=width + 1
    )[:, :-1]
    logprobs = logprobs_from_logits(logits, responses, TEMPERATURE).masked_fill(padding_mask, INVALID_LOGPROB)
    ref_logits = forward_grouped(
        ref_policy,
        query_responses,
        attention_mask,
        context_length=context_length,
        group=rollout_group,
        logits_to_keep=width + 1,
    )[:, :-1]
    ref_logprobs = logprobs_from_logits(ref_logits, responses, TEMPERATURE).masked_fill(padding_mask, INVALID_LOGPROB)
    del logits, ref_logits
    completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
    scores = torch.tensor(sentiment_reward(texts, completions), dtype=torch.float32)
    scored = torch.ones_like(scores, dtype=torch.bool)

    # 3. KL penalty
    kl = kl_estimate(logprobs, ref_logprobs, "k1").masked_fill(padding_mask, 0.0)
    non_score_reward = -cli.kl_coef * kl.sum(1)
    rlhf_reward = scores + non_score_reward

    # 4. RLOO: advantages from the leave-one-out baseline
    advantages = rloo_advantages(rlhf_reward, K, scored)
    if cli.normalize_advantage:
        mean, std = advantages[scored].mean(), advantages[scored].std()
        advantages = ((advantages - mean) / (std + 1e-8)).nan_to_num(0.0).masked_fill(~scored, 0.0)
    if cli.normalize_advantages:  # rloo.py --normalize_advantages (TRL 1.16's form)
        advantages = masked_whiten(advantages, scored, std_eps=1e-4).masked_fill(~scored, 0.0)
    seq_logprobs = logprobs.masked_fill(padding_mask, 0.0).sum(1)
log("completion lengths", lengths.tolist(), "width", width)
log("scores", [round(s, 3) for s in scores.tolist()])
log("KL per completion (k1, summed)", [round(x, 3) for x in kl.sum(1).tolist()])
log("advantages", [round(a, 3) for a in advantages.tolist()])
del ref_policy

# ------------------------------------------------------------------------------------------------------------------
# 5. OUR gradient: rloo.py's update lines (one epoch, one mini-batch; prompts in order: the summed gradient is
# order-free)
policy.train(False)  # policy.train(args.gradient_checkpointing) with gradient_checkpointing False
train_group = 1 if MICRO % K else K
b_inds = torch.arange(N_PROMPTS * K)
micro_batches = [b_inds[s : s + MICRO] for s in range(0, len(b_inds), MICRO)]
our_losses, our_new_seq = [], torch.zeros(len(b_inds))
policy.zero_grad(set_to_none=True)
for ga, micro_inds in enumerate(micro_batches):
    mb_padding = padding_mask[micro_inds]
    logits = forward_grouped(
        policy,
        query_responses[micro_inds],
        attention_mask[micro_inds],
        context_length=context_length,
        group=train_group,
        logits_to_keep=width + 1,
    )[:, :-1]
    new_logprobs, entropy = logprobs_from_logits(logits, responses[micro_inds], TEMPERATURE, with_entropy=True)
    new_logprobs = new_logprobs.masked_fill(mb_padding, 0.0)
    logprobs_diff = new_logprobs.sum(1) - seq_logprobs[micro_inds]
    ratio = torch.exp(logprobs_diff)
    mb_advantage = advantages[micro_inds]
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - CLIP, 1.0 + CLIP)
    pg_loss = torch.max(pg_losses, pg_losses2).mean()  # is_weight is 1 without --use_vllm
    scaled = pg_loss / GA  # accelerator.backward divides by gradient_accumulation_steps (Accelerator(GA=2))
    scaled.backward()
    our_losses.append(scaled.item())
    our_new_seq[micro_inds] = new_logprobs.sum(1).detach()
    log(f"ours micro-batch {ga}: pg_loss {pg_loss.item():.6e}, backpropagated {scaled.item():.6e}")
g_ours = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}
del policy, logits
log("ours done")

# ------------------------------------------------------------------------------------------------------------------
# 6. TRL's rollout scoring on the same completions, then its gradient
import datasets  # noqa: E402
from trl import RLOOConfig, RLOOTrainer  # noqa: E402

config = RLOOConfig(  # benchmark/curves/trl_real.py's fields with curves.py's values
    output_dir=cli.out,
    num_generations=K,
    per_device_train_batch_size=MICRO,
    gradient_accumulation_steps=GA,
    steps_per_generation=GA,
    num_iterations=1,
    max_completion_length=RESPONSE_LENGTH,
    temperature=TEMPERATURE,
    beta=cli.kl_coef,
    epsilon=CLIP,
    normalize_advantages=cli.normalize_advantage or cli.normalize_advantages,
    learning_rate=5e-5,
    adam_epsilon=1e-5,
    lr_scheduler_type="linear",
    max_steps=24,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    seed=SEED,
    disable_tqdm=True,
)
dataset = datasets.load_dataset("json", data_files=PROMPTS, split="train")
trainer = RLOOTrainer(  # the model as a path, so that TRL loads its own reference model from it (beta > 0)
    model=MODEL, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=load_tokenizer(MODEL)
)
tmodel = trainer.model
log("TRL loaded:", tmodel.dtype, tmodel.config._attn_implementation, "beta", trainer.beta,
    "eps", trainer.epsilon_low, trainer.epsilon_high, "normalize_advantages", trainer.normalize_advantages,
    "pad_to_multiple_of", trainer.pad_to_multiple_of, "reference", type(trainer.ref_model).__name__)  # fmt: skip
with torch.no_grad():  # the same perturbed policy; TRL's reference stays as it loaded
    for n, p in tmodel.named_parameters():
        p.copy_(w_ours[n])
wdiff = max((p.detach() - w_ours[n]).abs().max().item() for n, p in tmodel.named_parameters())
rdiff = max((p.detach() - w_ref[n]).abs().max().item() for n, p in trainer.ref_model.named_parameters())
log(f"weights max abs diff (TRL vs ours): policy {wdiff}, reference {rdiff} | params {len(w_ours)}")
del w_ours, w_ref
assert len(queries_all) == len(dataset)  # load_prompts keeps every row here (none is over 128 tokens)

# the sampler replaced: TRL's _generate tokenizes the prompts itself, then decodes what this returns
completion_ids_list = [responses[i, : lengths[i]].tolist() for i in range(len(responses))]  # up to and with the EOS


def sampled(prompt_ids, images, multimodal_fields):
    assert [list(p) for p in prompt_ids] == [queries_all[i] for i in idx for _ in range(K)], "TRL's prompt ids differ"
    return completion_ids_list


trainer._generate_single_turn = sampled
tmodel.train()  # the Trainer's training mode, which _generate_and_score_completions reads
rows = [dataset[i] for i in idx for _ in range(K)]  # RepeatSampler: each prompt K times in a row
out = trainer._generate_and_score_completions(rows)  # no shuffle_sequence_dict: the same micro-batches as ours
trl_scores = torch.tensor(list(trainer._logs["rewards"]["sentiment"]))
assert out["completion_ids"].shape[1] <= width and torch.equal(
    out["completion_ids"], responses[:, : out["completion_ids"].shape[1]]
)

# TRL's per-completion KL, from its own logprob passes (as it ran them, in chunks of per_device_train_batch_size)
twidth = out["completion_ids"].shape[1]
ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
amask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
with torch.no_grad():
    trl_lp = trainer._get_per_token_logps_and_entropies(tmodel, ids, amask, twidth, MICRO)[0]
    trl_ref_lp = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, amask, twidth, MICRO)[0]
trl_kl = ((trl_lp - trl_ref_lp) * out["completion_mask"]).sum(1)

inputs_list = [{key: value[mi] for key, value in out.items()} for mi in micro_batches]
trainer.current_gradient_accumulation_steps = GA  # the Trainer's inner loop sets it
feed = iter(inputs_list)
trainer._prepare_inputs = lambda _batch: next(feed)
tmodel.zero_grad(set_to_none=True)
trl_losses = []
for ga in range(GA):
    loss = trainer.training_step(tmodel, None, num_items_in_batch=None)  # compute_loss + accelerator.backward
    trl_losses.append(loss.item())
    log(f"TRL micro-batch {ga}: backpropagated loss {loss.item():.6e}, model.training={tmodel.training}")
g_trl = {n: p.grad.detach().clone() for n, p in tmodel.named_parameters() if p.grad is not None}

# ------------------------------------------------------------------------------------------------------------------
# 7. comparison
real = ~padding_mask
print()
print(f"tokens: {int(real.sum())} over {len(responses)} completions; prompt lengths {prompt_lengths}; noise {cli.noise}")
lp_diff = (logprobs[:, :twidth] - trl_lp)[real[:, :twidth]].abs()
print(
    f"per-token rollout logprobs |ours - TRL|, real tokens: max {lp_diff.max().item():.3e}, mean {lp_diff.mean().item():.3e}"
)
print(f"old sequence logprobs |ours - TRL|: max {(seq_logprobs - out['old_logps']).abs().max().item():.3e}")
print(f"scores |ours - TRL|: max {(scores - trl_scores).abs().max().item():.3e}")
kl_diff = (kl.sum(1) - trl_kl).abs().max().item()
print(f"KL per completion: ours mean {kl.sum(1).mean().item():.6f}, TRL {trl_kl.mean().item():.6f}, max |diff| {kl_diff:.3e}")
penalty = -non_score_reward
print(
    f"KL penalty kl_coef * KL: mean {penalty.mean().item():.4f}, from {penalty.min().item():.4f} to "
    f"{penalty.max().item():.4f} (the scores' std: {scores.std().item():.4f})"
)
adv_diff = (advantages - out["advantages"]).abs()
print(
    f"advantages |ours - TRL|: max {adv_diff.max().item():.3e} (|advantages| max {advantages.abs().max().item():.3f}), "
    f"relative {(adv_diff.norm() / out['advantages'].norm()).item():.3e}"
)
print("losses: 0 by construction on both sides (on policy, each prompt's advantages sum to 0), rounding only")
print(f"losses (as backpropagated, per micro-batch): ours {[f'{x:.6e}' for x in our_losses]} sum {sum(our_losses):.6e}")
print(f"                                             TRL  {[f'{x:.6e}' for x in trl_losses]} sum {sum(trl_losses):.6e}")
harness.gradient_report(g_ours, g_trl)
