"""llama.cpp's greedy decoding on a GGUF, as the engine's differential tests read it: for each
prompt, the prompt's ids (llama.cpp's tokenizer, BOS added as the file says), then N greedy
steps, each with its top-8 token ids and logits and the largest |logit|. One JSON document on
stdout. Usage: llamacpp_greedy.py MODEL.gguf --steps N [--rope-scaling yarn:4] PROMPT..."""
import argparse, json

import numpy as np
import llama_cpp

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("prompts", nargs="+")
ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--rope-scaling", help="KIND:FACTOR[:ORIGINAL_CONTEXT], as Hearth's --rope-scaling")
ap.add_argument("--n-ctx", type=int, default=512, help="the context (LongRoPE picks its factors by it)")
a = ap.parse_args()

rope = {}
if a.rope_scaling:
    kind, factor, *orig = a.rope_scaling.split(":")
    kinds = {"linear": llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR, "yarn": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN}
    rope = dict(rope_scaling_type=kinds[kind], rope_freq_scale=1.0 / float(factor),
                yarn_orig_ctx=int(orig[0]) if orig else 0)
llm = llama_cpp.Llama(model_path=a.model, n_ctx=a.n_ctx, n_batch=512, n_threads=a.threads,
                      logits_all=True, verbose=False, **rope)
out = {"model": a.model, "system_info": llama_cpp.llama_print_system_info().decode(), "prompts": []}
for text in a.prompts:
    llm.reset()
    ids = llm.tokenize(text.encode(), add_bos=True, special=False)
    llm.eval(ids)
    steps = []
    for _ in range(a.steps):
        row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top = np.argsort(-row, kind="stable")[:8]
        steps.append({"top": [int(t) for t in top], "logits": [float(row[t]) for t in top],
                      "max_abs": float(np.abs(row).max())})
        llm.eval([int(top[0])])
    out["prompts"].append({"text": text, "ids": [int(i) for i in ids], "steps": steps})
print(json.dumps(out))
