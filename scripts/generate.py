"""Sample text from an export of the text example (experiment=text_gpt), in plain PyTorch: no
Hydra, no config, no process group; only the export folder.

    python -m hydra_ddp.export run=outputs/<date>/<time>       # -> <run>/export/step_<N>/
    python scripts/generate.py outputs/<date>/<time>/export/step_00000600 --prompt "The "

`hydra_ddp.export.load` rebuilds the model from the folder's config.json (its class and
arguments) and loads model.safetensors; `vocabulary` reads vocab.json, the characters the
model's ids stand for.
"""

from __future__ import annotations

import argparse

import torch

from hydra_ddp.export import load, read_config, vocabulary


def generate(folder: str, prompt: str, tokens: int, temperature: float, seed: int) -> str:
    """The prompt followed by `tokens` sampled characters."""
    model, vocab = load(folder), vocabulary(folder)
    context = read_config(folder)["spec"]["block_size"]  # the longest input the model takes
    ids = torch.tensor([vocab.encode(prompt)])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(ids[:, -context:])[:, -1] / temperature
            next_id = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            ids = torch.cat([ids, next_id], dim=1)
    return vocab.decode(ids[0].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="an export folder (python -m hydra_ddp.export)")
    parser.add_argument("--prompt", default="The ")
    parser.add_argument("--tokens", type=int, default=40, help="characters to sample")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(generate(args.folder, args.prompt, args.tokens, args.temperature, args.seed))


if __name__ == "__main__":
    main()
