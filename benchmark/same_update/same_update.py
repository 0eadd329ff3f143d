"""One GRPO update on identical inputs, grpo.py's update lines against TRL 1.16's GRPOTrainer.training_step: the
same prompts (the first update's of a seed, left-padded to different lengths), the same sampled completions, rewards
and advantages, the same weights. Prints both sides' per-token logprobs, losses and gradients and how far apart they
are; a relative gradient difference near 1e-5 is float32 rounding.

    python benchmark/same_update/same_update.py --seed 1   # SmolLM2-135M-Instruct (benchmark/.models, made by curves.py)

The settings are those of `curves.py grpo --task sentiment`: 4 prompts x 4 completions, micro-batches of 8 (two
whole prompts each), two gradient-accumulation steps, 24 response tokens, temperature 0.7, dapo loss, group scaling,
beta 0, clip 0.2, fp32. Our side imports grpo.py's own `group_advantages`, `policy_loss`, `off_policy_keep` and
`aggregate_loss` and repeats the few lines of its update between them; TRL's side runs its real training_step with
`_prepare_inputs` handing it the same micro-batches in its own format, so compute_loss, its loss scaling and
accelerator.backward all run.

The other loss types and corrections, each with its TRL 1.16 field set the same on both sides: --loss_type cispo, sapo,
luspo (with --importance_sampling_level sequence, as TRL advises), vespo; --importance_sampling_level sequence (GSPO's
ratio, under dapo by default as TRL's); --delta; --off_policy_mask_threshold; --beta
with the bias-corrected KL (TRL's default); --entropy_coef (TRL's bonus); --top_k/--top_p (the completions are drawn by
the truncated rule; both sides' losses read the untruncated logprobs). On policy every ratio is 1, where most of them
coincide, so --old_noise S hands both sides old logprobs (and --beta a reference's) that are the policy's plus Gaussian
noise of std S, as an earlier iteration's would be: the ratios then spread around 1 and every branch is taken."""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repository's root: the scripts, utils, infra, benchmark.harness
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from benchmark import harness  # noqa: E402
from grpo import aggregate_loss, group_advantages, off_policy_keep, policy_loss, sequence_log_ratio  # noqa: E402
from infra.data import left_pad, load_prompts, truncate_response  # noqa: E402
from infra.decode import generate  # noqa: E402
from infra.models import load_pretrained, load_tokenizer  # noqa: E402
from infra.rewards import sentiment_reward  # noqa: E402
from utils import (  # noqa: E402
    INVALID_LOGPROB,
    forward_grouped,
    kl_estimate,
    logprobs_from_logits,
    sampling_logits,
)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1, help="picks the prompts and the sampling noise, as grpo.py's")
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--out", default="/tmp/same_update", help="TRL's output_dir (nothing is saved there)")
parser.add_argument("--loss_type", default="dapo", choices=["grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
parser.add_argument("--epsilon_high", type=float, default=None, help="None: the clip's 0.2 (cispo: its cap)")
parser.add_argument("--delta", type=float, default=None)
parser.add_argument("--off_policy_mask_threshold", type=float, default=None)
parser.add_argument("--beta", type=float, default=0.0, help="with the bias-corrected KL, TRL's default")
parser.add_argument("--top_k", type=int, default=0)
parser.add_argument("--top_p", type=float, default=1.0)
parser.add_argument("--entropy_coef", type=float, default=0.0, help="TRL's entropy bonus")
parser.add_argument("--old_noise", type=float, default=0.0, help="the old (and reference) logprobs' distance")
parser.add_argument("--importance_sampling_level", choices=["token", "sequence"], help="default: sequence for luspo")
cli = parser.parse_args()
MODEL, PROMPTS, SEED = cli.model, os.path.join(REPO, "data", "prompts.jsonl"), cli.seed
K, N_PROMPTS, RESPONSE_LENGTH, TEMPERATURE, MICRO, GA, EPS = 4, 4, 24, 0.7, 8, 2, 0.2
EPS_HIGH = EPS if cli.epsilon_high is None else cli.epsilon_high
LEVEL = cli.importance_sampling_level or ("sequence" if cli.loss_type == "luspo" else "token")
log = print


# ------------------------------------------------------------------------------------------------------------------
# 1-2. model, tokenizer, one batch as grpo.py builds it
tokenizer = load_tokenizer(MODEL)
stop_token_id = tokenizer.eos_token_id  # grpo.py: --stop_token eos, no --stop_token_id
queries_all, prompt_texts, _, columns = load_prompts(
    dataset_name=PROMPTS, split="train", prompt_field="prompt", tokenizer=tokenizer, max_prompt_length=128
)
policy = load_pretrained(AutoModelForCausalLM, MODEL)
policy.eval()
log("ours loaded:", policy.dtype, policy.config._attn_implementation, "training:", policy.training)

data_rng = torch.Generator().manual_seed(SEED)  # as grpo.py's first update
order = torch.randperm(len(queries_all), generator=data_rng)
idx = order[:N_PROMPTS].tolist()
uniforms = torch.rand((N_PROMPTS, K, RESPONSE_LENGTH), generator=data_rng).reshape(-1, RESPONSE_LENGTH)
prompt_lengths = [len(queries_all[i]) for i in idx]
log("prompt rows", idx, "token lengths", prompt_lengths)
queries, query_mask = left_pad([queries_all[i] for i in idx], tokenizer.pad_token_id)
queries = queries.repeat_interleave(K, 0)
query_mask = query_mask.repeat_interleave(K, 0)
texts = [prompt_texts[i] for i in idx for _ in range(K)]
context_length = queries.shape[1]

with torch.no_grad():
    response = generate(
        model=policy,
        queries=queries,
        query_mask=query_mask,
        response_length=RESPONSE_LENGTH,
        rule=lambda logits, seen: sampling_logits(logits, seen, temperature=TEMPERATURE, top_k=cli.top_k, top_p=cli.top_p),
        stop_token_id=stop_token_id,
        uniforms=uniforms,
        group=K,  # rollout_group: 64 % 4 == 0
    )
    responses, lengths = truncate_response(response, stop_token_id, tokenizer.pad_token_id)
    width = responses.shape[1]
    completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
    scores = torch.tensor(sentiment_reward(texts, completions), dtype=torch.float32)
    padding_mask = torch.arange(width)[None, :] >= lengths[:, None]
    query_responses = torch.cat([queries, responses], 1)
    attention_mask = torch.cat([query_mask, (~padding_mask).long()], 1)
    scored = torch.ones_like(scores, dtype=torch.bool)
    loss_mask = ~padding_mask & scored[:, None]
    advantages, _ = group_advantages(scores, K, "group", scored=scored)
log("completion lengths", lengths.tolist(), "width", width)
log("scores", [round(s, 3) for s in scores.tolist()])
log("advantages", [round(a, 3) for a in advantages.tolist()])

# off policy (--old_noise): old and reference logprobs, the policy's plus noise, the same on both sides
old_logprobs = ref_logprobs = None
if cli.old_noise or cli.beta:
    with torch.no_grad():
        logits = forward_grouped(policy, query_responses, attention_mask, context_length, group=1, logits_to_keep=width + 1)
        current = logprobs_from_logits(logits[:, :-1], responses, TEMPERATURE).masked_fill(padding_mask, 0.0)
    noise = torch.Generator().manual_seed(SEED + 7)
    old_logprobs = current + cli.old_noise * torch.randn(current.shape, generator=noise)
    ref_logprobs = current + cli.old_noise * torch.randn(current.shape, generator=noise)
    old_logprobs, ref_logprobs = (x.masked_fill(padding_mask, 0.0) for x in (old_logprobs, ref_logprobs))

# ------------------------------------------------------------------------------------------------------------------
# 3. OUR gradient: grpo.py's update lines (on policy: one iteration, one mini-batch)
policy.train(False)  # policy.train(args.gradient_checkpointing) with gradient_checkpointing False
train_group = 1 if MICRO % K else K
b_inds = torch.arange(N_PROMPTS)[:, None] * K + torch.arange(K)  # (no shuffle: the summed gradient is order-free)
b_inds = b_inds.flatten()
step_tokens = loss_mask[b_inds].sum(1).reshape(1, -1).sum(1).float()
dapo_tokens = step_tokens.clamp(min=1.0) / (1 * GA)  # world_size 1
logprobs = torch.full(responses.shape, INVALID_LOGPROB)
current_logprobs = torch.full(responses.shape, INVALID_LOGPROB)  # the policy's own, for the report
micro_batches = [b_inds[s : s + MICRO] for s in range(0, len(b_inds), MICRO)]
our_losses = []
policy.zero_grad(set_to_none=True)
for ga, micro_inds in enumerate(micro_batches):
    mb_padding, mb_mask = padding_mask[micro_inds], loss_mask[micro_inds]
    logits = forward_grouped(
        policy,
        query_responses[micro_inds],
        attention_mask[micro_inds],
        context_length=context_length,
        group=train_group,
        logits_to_keep=width + 1,
    )[:, :-1]
    new_logprobs, entropy = logprobs_from_logits(logits, responses[micro_inds], TEMPERATURE, with_entropy=True)
    new_logprobs = new_logprobs.masked_fill(mb_padding, INVALID_LOGPROB)
    current_logprobs[micro_inds] = new_logprobs.detach()
    if old_logprobs is None:
        logprobs[micro_inds] = new_logprobs.detach()  # on_policy
    else:
        logprobs[micro_inds] = old_logprobs[micro_inds].masked_fill(mb_padding, INVALID_LOGPROB)
    logprobs_diff = new_logprobs - logprobs[micro_inds]
    if LEVEL == "sequence":
        ratio = torch.exp(sequence_log_ratio(logprobs_diff, mb_mask))
    else:
        ratio = torch.exp(logprobs_diff)
    mb_advantage = advantages[micro_inds][:, None]
    per_token_loss = policy_loss(
        cli.loss_type, ratio=ratio, log_ratio=logprobs_diff, logprobs=new_logprobs, advantages=mb_advantage, is_weight=None,
        mask=mb_mask, epsilon=EPS, epsilon_high=EPS_HIGH, delta=cli.delta, sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0),
    )  # fmt: skip
    if cli.off_policy_mask_threshold is not None:
        keep = off_policy_keep(mb_advantage, new_logprobs, logprobs[micro_inds], mb_mask, cli.off_policy_mask_threshold)
        per_token_loss = per_token_loss * keep
        log(f"ours micro-batch {ga}: the off-policy mask keeps {int(keep.sum())} of {len(keep)} completions")
    if cli.beta:
        kl = kl_estimate(new_logprobs, ref_logprobs[micro_inds].masked_fill(mb_padding, INVALID_LOGPROB), "k3") * ratio
        per_token_loss = per_token_loss + cli.beta * kl
    pg_loss = aggregate_loss(
        per_token_loss, mb_mask, loss_type=cli.loss_type, response_length=RESPONSE_LENGTH, dapo_tokens=dapo_tokens[0]
    )
    if cli.entropy_coef:  # grpo.py's bonus: the mean entropy of the loss tokens (no --top_entropy_quantile here)
        counted = mb_mask.to(entropy.dtype)
        pg_loss = pg_loss - cli.entropy_coef * (entropy * counted).sum() / counted.sum().clamp(min=1.0)
    scaled = pg_loss / GA  # accelerator.backward divides by gradient_accumulation_steps (Accelerator(GA=2), not DeepSpeed)
    scaled.backward()
    our_losses.append(scaled.item())
    log(f"ours micro-batch {ga}: pg_loss {pg_loss.item():.6e}, backpropagated {scaled.item():.6e}")
g_ours = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}
w_ours = {n: p.detach().clone() for n, p in policy.named_parameters()}
del policy, logits
log("ours done")

# ------------------------------------------------------------------------------------------------------------------
# 4. TRL's gradient on the same prompts, completions and advantages
import datasets  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def reward(prompts, completions, **columns):  # never called: no generation happens here
    return [0.0] * len(completions)


reward.__name__ = "sentiment"
config = GRPOConfig(  # benchmark/curves/trl_real.py's fields with curves.py's values (beta 0.0 for grpo)
    output_dir=cli.out,
    num_generations=K,
    per_device_train_batch_size=MICRO,
    gradient_accumulation_steps=GA,
    steps_per_generation=GA,
    num_iterations=1,
    max_completion_length=RESPONSE_LENGTH,
    temperature=TEMPERATURE,
    beta=cli.beta,
    loss_type=cli.loss_type,
    importance_sampling_level=LEVEL,
    epsilon_high=cli.epsilon_high,
    delta=cli.delta,
    off_policy_mask_threshold=cli.off_policy_mask_threshold,
    top_k=cli.top_k,
    top_p=cli.top_p,
    entropy_coef=cli.entropy_coef,
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
trainer = GRPOTrainer(
    model=MODEL, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=load_tokenizer(MODEL)
)
tmodel = trainer.model
log("TRL loaded:", tmodel.dtype, tmodel.config._attn_implementation, "loss_type", trainer.loss_type,
    "scale_rewards", trainer.scale_rewards, "eps", trainer.epsilon_low, trainer.epsilon_high,
    "pad_to_multiple_of", trainer.pad_to_multiple_of, "loss_is_scaled_for_ga", trainer.loss_is_scaled_for_ga)  # fmt: skip
wdiff = max((p.detach() - w_ours[n]).abs().max().item() for n, p in tmodel.named_parameters())
log("initial weights max abs diff (TRL vs ours):", wdiff, "| params", len(w_ours), len(list(tmodel.named_parameters())))
del w_ours
# TRL's own tokenization of the same dataset rows (load_prompts keeps every row here: none is over 128 tokens)
assert len(queries_all) == len(dataset)
trl_prompt_ids, _, _ = trainer._tokenize_prompts([dataset[i]["prompt"] for i in idx])
log(
    "TRL's prompt token ids == load_prompts':",
    [list(a) == list(b) for a, b in zip(trl_prompt_ids, (queries_all[i] for i in idx))],
)

# TRL's format: prompts left-padded, completions right-padded, over the whole generation batch (then split)
prompt_list = [queries_all[i] for i in idx for _ in range(K)]
prompt_ids, prompt_mask = left_pad(prompt_list, tokenizer.pad_token_id)  # == queries, query_mask
assert torch.equal(prompt_ids, queries) and torch.equal(prompt_mask, query_mask)
# truncate_response already right-pads after the stop token, which the completion keeps, as TRL's do
completion_ids, completion_mask = responses, (~padding_mask).long()
num_items_in_batch = completion_mask.sum()  # accelerator.gather(loss_mask.sum()).sum(), one process
inputs_list = [
    {
        "prompt_ids": prompt_ids[mi],
        "prompt_mask": prompt_mask[mi],
        "completion_ids": completion_ids[mi],
        "completion_mask": completion_mask[mi],
        "advantages": advantages[mi],
        "num_items_in_batch": num_items_in_batch,
        # on policy, no old_per_token_logps: gradient_accumulation_steps % (steps_per_generation * num_iterations) == 0
        **({"old_per_token_logps": old_logprobs[mi]} if old_logprobs is not None else {}),
        **({"ref_per_token_logps": ref_logprobs[mi]} if cli.beta else {}),
    }
    for mi in micro_batches
]

# the Trainer's inner loop sets these; training_step's _prepare_inputs would otherwise generate anew
trainer.current_gradient_accumulation_steps = GA
feed = iter(inputs_list)
trainer._prepare_inputs = lambda _batch: next(feed)
tmodel.zero_grad(set_to_none=True)
trl_losses = []
for ga in range(GA):
    loss = trainer.training_step(tmodel, None, num_items_in_batch=None)  # compute_loss + accelerator.backward
    trl_losses.append(loss.item())
    log(f"TRL micro-batch {ga}: backpropagated loss {loss.item():.6e}, model.training={tmodel.training}")
g_trl = {n: p.grad.detach().clone() for n, p in tmodel.named_parameters() if p.grad is not None}

# TRL's own per-token logprobs (the same forward its loss used), no gradient
trl_lp = torch.zeros(responses.shape)
with torch.no_grad():
    for mi in micro_batches:
        lp, _, _ = trainer._get_per_token_logps_and_entropies(
            tmodel,
            torch.cat([prompt_ids[mi], completion_ids[mi]], 1),
            torch.cat([prompt_mask[mi], completion_mask[mi]], 1),
            width,
            compute_entropy=True,
        )
        trl_lp[mi] = lp

# ------------------------------------------------------------------------------------------------------------------
# 5. comparison
real = loss_mask
lp_diff = (current_logprobs - trl_lp)[real].abs()
print()
print(f"tokens in the loss: {int(real.sum())} over {len(responses)} completions; prompt lengths {prompt_lengths}")
print(f"per-token logprobs |ours - TRL|, real tokens: max {lp_diff.max().item():.3e}, mean {lp_diff.mean().item():.3e}")
print(f"losses (as backpropagated, per micro-batch): ours {[f'{x:.6e}' for x in our_losses]} sum {sum(our_losses):.6e}")
print(f"                                             TRL  {[f'{x:.6e}' for x in trl_losses]} sum {sum(trl_losses):.6e}")
harness.gradient_report(g_ours, g_trl)
