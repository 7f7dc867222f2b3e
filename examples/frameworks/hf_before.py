"""A tiny Hugging Face Trainer script: hf_before.py on torchrun (DDP through Accelerate),
hf_after.py the same with one line changed (docs/porting.md, "Hugging Face Trainer").

    torchrun --standalone --nproc-per-node 2 examples/frameworks/hf_before.py --max-steps 40
    ceaseless up --workers 2 --spares 1 -- python examples/frameworks/hf_after.py --max-steps 40
    python examples/frameworks/hf_after.py --max-steps 40     # one process (either file)

A 2-layer GPT-2 built from its config (no downloads) on synthetic tokens: a random Markov chain
over 64 tokens, each with at most 4 successors. Gradient accumulation, clipping, a cosine LR
schedule with warm-up; --eval-steps / --save-steps turn on the evaluation and the checkpoints.
Rank 0 writes the final parameters' sha256 to --out.
"""

import argparse
import hashlib
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
from transformers import Trainer

p = argparse.ArgumentParser()
p.add_argument('--max-steps', type=int, default=40)
p.add_argument('--batch-size', type=int, default=4)       # per rank and micro-batch
p.add_argument('--grad-accum', type=int, default=2)
p.add_argument('--eval-steps', type=int, default=0)       # 0: no evaluation
p.add_argument('--save-steps', type=int, default=0)       # 0: no checkpoints
p.add_argument('--output-dir', default='out-hf')
p.add_argument('--resume', default=None)                  # a checkpoint directory
p.add_argument('--out', default=None)  # rank 0 writes the final parameters' sha256 here
p.add_argument('--step-sleep', type=float, default=0.0)  # seconds per step and evaluation batch
p.add_argument('--save-sleep', type=float, default=0.0)  # seconds inside each checkpoint's save
p.add_argument('--n-embd', type=int, default=32)  # the model's width (bench: a larger step)
p.add_argument('--times', default=None)  # rank 0 writes each step's end time here (bench)
args = p.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        succ = torch.randint(0, 64, (64, 4), generator=torch.Generator().manual_seed(0))
        x = torch.empty(n, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, 64, (n,), generator=g)
        for i in range(1, seq):
            x[:, i] = succ[x[:, i - 1], torch.randint(0, 4, (n,), generator=g)]
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {'input_ids': self.x[i], 'labels': self.x[i]}


class Sleep(TrainerCallback):  # time for tests to kill a rank in a step, evaluation or save
    times = []  # each step's end (bench)

    def on_step_end(self, *a, **kw):
        self.times.append(time.perf_counter())
        time.sleep(args.step_sleep)

    def on_prediction_step(self, targs, state, control, **kw):  # after an evaluation batch
        print(f'evaluating after step {state.global_step}', flush=True)
        time.sleep(args.step_sleep)


class SlowSave(Trainer):
    def save_model(self, output_dir=None, _internal_call=False):
        super().save_model(output_dir, _internal_call)  # a checkpoint's weights; the rest next
        if _internal_call:
            print(f'saving a checkpoint at step {self.state.global_step}', flush=True)
            time.sleep(args.save_sleep)


torch.manual_seed(1337)  # the initial weights
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=args.n_embd, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0))
targs = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.max_steps, seed=0, use_cpu=True,
    per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
    learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type='cosine', warmup_steps=4,
    max_grad_norm=1.0, logging_steps=10, report_to='none', disable_tqdm=True,
    eval_strategy='steps' if args.eval_steps else 'no', eval_steps=args.eval_steps or None,
    save_strategy='steps' if args.save_steps else 'no', save_steps=args.save_steps or 500)
trainer = SlowSave(model=model, args=targs, train_dataset=Tokens(256),
                   eval_dataset=Tokens(32, seed=1) if args.eval_steps else None,
                   callbacks=[Sleep()])
trainer.train(resume_from_checkpoint=args.resume)
if trainer.is_world_process_zero():
    digest = hashlib.sha256(b''.join(t.detach().cpu().numpy().tobytes()
                                     for t in model.state_dict().values())).hexdigest()
    print(f'step {trainer.state.global_step}: parameters sha256 {digest}')
    if args.out:
        with open(args.out, 'w') as f:
            f.write(digest + '\n')
    if args.times:
        with open(args.times, 'w') as f:
            f.write(' '.join(f'{t:.6f}' for t in Sleep.times) + '\n')
