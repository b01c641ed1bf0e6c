"""llama.cpp's greedy decoding on a GGUF, as the engine's differential tests read it: for each
prompt, the prompt's ids (llama.cpp's tokenizer, BOS added as the file says), then N greedy
steps, each with its top-8 token ids and logits and the largest |logit|. One JSON document on
stdout. Usage: llamacpp_greedy.py MODEL.gguf --steps N PROMPT..."""
import argparse, json

import numpy as np
import llama_cpp

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("prompts", nargs="+")
ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()

llm = llama_cpp.Llama(model_path=a.model, n_ctx=512, n_batch=512, n_threads=a.threads,
                      logits_all=True, verbose=False)
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
