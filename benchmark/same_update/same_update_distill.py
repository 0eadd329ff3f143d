"""One distillation update on identical inputs, distill.py's update lines against TRL 1.16's DistillationTrainer: the
same prompts (the first update's of a seed, left-padded to different lengths), the same sampled completions, the same
student and teacher weights. Each side runs its own forward passes of both models and its own divergence; the script
prints how far apart the backpropagated losses (per micro-batch and summed) and the gradients are. A relative gradient
difference near 1e-5 is float32 rounding.

    /path/to/venv-with-trl/bin/python benchmark/same_update/same_update_distill.py --seed 1

The settings are those of benchmark/distill/distill_trl.py: the teacher is the RLOO policy that distill_demo.py
trains (--teacher), the student SmolLM2-135M-Instruct, 16 prompts of examples/distill/cheerful.jsonl, micro-batches
of 8, two gradient-accumulation steps, 24 response tokens, temperature 0.7, the reverse KL (--beta 1; 0 and 0.5
are the forward KL and the JSD), fp32.

Our side imports distill.py's own `generalized_jsd` and repeats the lines of its update (utils.forward_grouped for both
models, the loss summed over the micro-batch's tokens and divided by the step's tokens per accumulation step, backward
divided by the accumulation steps as accelerate does). TRL's side runs its real `_generate_and_score_completions` with
only the sampler replaced (`_generate_single_turn` hands back our completions' token ids): its tokenization of the
prompts, its padding and its count of the step's tokens; the output is split into the same two micro-batches, which
`_prepare_inputs` hands to its real `training_step` (compute_loss: the backbones with logits_to_keep, its chunked
divergence over the lm_head, the Trainer's loss scaling and accelerator.backward)."""

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
from distill import generalized_jsd  # noqa: E402  (distill.py's own function; its main is guarded)
from infra.data import Shuffled, left_pad, load_prompts, truncate_response  # noqa: E402
from infra.decode import generate  # noqa: E402
from infra.models import load_pretrained, load_tokenizer  # noqa: E402
from utils import forward_grouped, logprobs_from_logits  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seed", type=int, default=1, help="picks the prompts and the sampling noise")
parser.add_argument("--model", default=harness.SMOLLM2, type=harness.model_folder)
parser.add_argument("--teacher", default=harness.DISTILL_TEACHER)
parser.add_argument("--beta", type=float, default=1.0, help="the generalised JSD's beta on both sides (0, 0.5, 1)")
parser.add_argument("--out", default="/tmp/same_update_distill", help="TRL's output_dir (nothing is saved there)")
cli = parser.parse_args()
if not os.path.exists(os.path.join(cli.teacher, "config.json")):
    sys.exit(f"error: no teacher at {cli.teacher}: run benchmark/distill/distill_demo.py --tasks rloo, or pass --teacher")
MODEL, TEACHER, SEED = cli.model, cli.teacher, cli.seed
N, RESPONSE_LENGTH, TEMPERATURE, MICRO, GA, BETA = 16, 24, 0.7, 8, 2, cli.beta
log = print

# ------------------------------------------------------------------------------------------------------------------
# 1. student, teacher, tokenizer, one batch as distill.py's first update draws it
tokenizer = load_tokenizer(MODEL)
stop_token_id = tokenizer.eos_token_id  # distill.py: --stop_token eos
queries_all, _, _, _ = load_prompts(
    dataset_name=harness.DISTILL_PROMPTS, split="train", prompt_field="prompt", tokenizer=tokenizer, max_prompt_length=128
)
student = load_pretrained(AutoModelForCausalLM, MODEL).eval()
teacher = load_pretrained(AutoModelForCausalLM, TEACHER).eval().requires_grad_(False)
log("ours loaded:", student.dtype, student.config._attn_implementation, "teacher", teacher.dtype)
data = Shuffled(len(queries_all), SEED)
idx = data.take(N)
uniforms = torch.rand((N, RESPONSE_LENGTH), generator=data.rng)
prompt_lengths = [len(queries_all[i]) for i in idx]
queries, query_mask = left_pad([queries_all[i] for i in idx], tokenizer.pad_token_id)
context_length = queries.shape[1]

# 2. the student's completions (infra.decode.generate, as infra.Sampler calls it)
with torch.no_grad():
    response = generate(
        model=student,
        queries=queries,
        query_mask=query_mask,
        response_length=RESPONSE_LENGTH,
        rule=TEMPERATURE,
        stop_token_id=stop_token_id,
        uniforms=uniforms,
    )
responses, lengths = truncate_response(response, stop_token_id, tokenizer.pad_token_id)
width = responses.shape[1]
padding_mask = torch.arange(width)[None, :] >= lengths[:, None]
query_responses = torch.cat([queries, responses], 1)
attention_mask = torch.cat([query_mask, (~padding_mask).long()], 1)
log("prompt token lengths", prompt_lengths, "completion lengths", lengths.tolist())

# ------------------------------------------------------------------------------------------------------------------
# 3. OUR gradient: distill.py's update lines (--loss jsd; one mini-batch of two micro-batches)
micro_batches = [torch.arange(s, s + MICRO) for s in range(0, N, MICRO)]
step_tokens = (~padding_mask).sum().float() / GA  # run.reduce_sum(...) / (world_size * gradient_accumulation_steps)
w_ours = {n: p.detach().clone() for n, p in student.named_parameters()}
student.zero_grad(set_to_none=True)
our_losses = []
for micro in micro_batches:
    mb_mask = ~padding_mask[micro]
    logits = forward_grouped(
        student,
        query_responses[micro],
        attention_mask[micro],
        context_length=context_length,
        group=1,
        logits_to_keep=width + 1,
    )[:, :-1]
    with torch.no_grad():
        teacher_logits = forward_grouped(
            teacher,
            query_responses[micro],
            attention_mask[micro],
            context_length=context_length,
            group=1,
            logits_to_keep=width + 1,
        )[:, :-1]
    per_token_loss = generalized_jsd(logits, teacher_logits, BETA, TEMPERATURE)
    loss = per_token_loss.masked_fill(~mb_mask, 0.0).sum() / step_tokens
    scaled = loss / GA  # accelerator.backward divides by gradient_accumulation_steps
    scaled.backward()
    our_losses.append(scaled.item())
    sampled_kl = (
        logprobs_from_logits(logits.detach(), responses[micro], TEMPERATURE)
        - logprobs_from_logits(teacher_logits, responses[micro], TEMPERATURE)
    ).masked_fill(~mb_mask, 0.0)
    log(f"ours micro-batch: backpropagated {scaled.item():.6e}, sampled-token KL sum {sampled_kl.sum().item():.4f}")
g_ours = {n: p.grad.detach().clone() for n, p in student.named_parameters() if p.grad is not None}
del student, teacher, logits, teacher_logits
log("ours done")

# ------------------------------------------------------------------------------------------------------------------
# 4. TRL's batch from the same completions, then its gradient
import datasets  # noqa: E402
from trl import DistillationTrainer  # noqa: E402

config = harness.distill_config(output_dir=cli.out, seed=SEED, updates=12, per_device=MICRO, accumulation=GA, beta=BETA)
dataset = datasets.load_dataset("json", data_files=harness.DISTILL_PROMPTS, split="train").remove_columns(["teacher_prompt"])
trainer = DistillationTrainer(
    model=MODEL, teacher_model=TEACHER, args=config, train_dataset=dataset, processing_class=load_tokenizer(MODEL)
)
tmodel = trainer.model
log("TRL loaded:", tmodel.dtype, tmodel.config._attn_implementation, "teacher", trainer.teacher_model.dtype)
wdiff = max((p.detach() - w_ours[n]).abs().max().item() for n, p in tmodel.named_parameters())
log(f"student weights max abs diff (TRL vs ours): {wdiff}")
assert wdiff == 0.0
assert len(queries_all) == len(dataset)  # load_prompts keeps every row here (none is over 128 tokens)

completion_ids_list = [responses[i, : lengths[i]].tolist() for i in range(N)]  # up to and with the EOS


def sampled(prompt_ids, images, multimodal_fields):
    assert [list(p) for p in prompt_ids] == [queries_all[i] for i in idx], "TRL's prompt ids differ"
    return completion_ids_list


trainer._generate_single_turn = sampled
tmodel.train()  # the Trainer's training mode, which _generate_and_score_completions reads
out = trainer._generate_and_score_completions([dataset[i] for i in idx])  # not shuffled: the same micro-batches
assert torch.equal(out["completion_ids"], responses[:, : out["completion_ids"].shape[1]])
log("TRL's step tokens", int(out["num_items_in_batch"]), "ours", int((~padding_mask).sum()))

inputs_list = [
    {key: (value[mi] if torch.is_tensor(value) and value.dim() > 0 else value) for key, value in out.items()}
    for mi in micro_batches
]
trainer.current_gradient_accumulation_steps = GA  # the Trainer's inner loop sets it
feed = iter(inputs_list)
trainer._prepare_inputs = lambda _batch: next(feed)
tmodel.zero_grad(set_to_none=True)
trl_losses = []
for _ in range(GA):
    loss = trainer.training_step(tmodel, None, num_items_in_batch=None)  # compute_loss + accelerator.backward
    trl_losses.append(loss.item())
    log(f"TRL micro-batch: backpropagated {loss.item():.6e}")
g_trl = {n: p.grad.detach().clone() for n, p in tmodel.named_parameters() if p.grad is not None}

# ------------------------------------------------------------------------------------------------------------------
# 5. comparison
print()
print(f"tokens: {int((~padding_mask).sum())} over {N} completions; prompt lengths {prompt_lengths}")
print(f"losses (as backpropagated, per micro-batch): ours {[f'{x:.6e}' for x in our_losses]} sum {sum(our_losses):.6e}")
print(f"                                             TRL  {[f'{x:.6e}' for x in trl_losses]} sum {sum(trl_losses):.6e}")
print(f"loss |ours - TRL| / TRL: {abs(sum(our_losses) - sum(trl_losses)) / abs(sum(trl_losses)):.3e}")
harness.gradient_report(g_ours, g_trl)
