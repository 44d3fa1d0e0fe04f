"""Stand-ins for `trl vllm-serve` and colocated `vllm.LLM`, backed by a transformers model: vLLM paths without vLLM.

In trl 1.16, `trl vllm-serve` runs vLLM's own OpenAI-compatible server (`vllm serve ... --weight-transfer-config
'{"backend": "nccl"}' --logprobs-mode processed_logprobs`, with `VLLM_SERVER_DEV_MODE=1`), and
`trl.generation.VLLMClient` talks to it over HTTP. `StandinServer` answers the same routes on 127.0.0.1, with vLLM's
request and response schemas, and records every request (`requests`, and `responses` for `/v1/completions`):

- `GET /health`, `GET /v1/models` (`check_server`, `VLLMClient.__init__`): 200; the served model's id.
- `GET /server_info?config_format=json` (`get_server_info`): `{"vllm_config": ...}` with a `weight_transfer_config`
  and `model_config.logprobs_mode = "processed_logprobs"`. `GET /get_world_size`: `{"world_size": 1}`.
- `POST /v1/completions` (`VLLMClient.generate`, what GRPO uses): `prompt` (a list of token-id lists, or text), `n`,
  `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_tokens`, `logprobs`, `return_token_ids`,
  `return_tokens_as_token_ids`, and the trainer's `generation_kwargs` (`stop`, `include_stop_str_in_output`, `seed`).
  It samples `n` completions per prompt, choices prompt-major, and returns `prompt_token_ids`, `token_ids` and
  `logprobs` (`tokens` as `token_id:<id>`, `token_logprobs`, `top_logprobs`).
- `POST /v1/chat/completions` (`VLLMClient.chat`): one conversation in `messages`, the same sampling fields,
  `logprobs` a bool and `top_logprobs` a count; the chat template is rendered with the generation prompt.
- `POST /init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`
  (`init_communicator`, `update_named_params`): the group's `init_info`, then the names, dtypes and shapes of the
  tensors about to be broadcast; `/update_weights` waits for the broadcast tensors, checks them against what was
  announced and loads them into the model. `POST /reset_prefix_cache`: `{"success": true}`.

A request field the stand-in does not know is refused with a 400 naming it (a misspelt sampling field fails a test
instead of being ignored); TRL's client does not retry a 400.

What is faked, and only that (`patch_trl`): vLLM is not installed, so `is_vllm_available()` is made True in TRL's two
vLLM modules; the NCCL weight transfer cannot run without CUDA, so vLLM's `NCCLWeightTransferEngine` (its
`trainer_init` rendezvous and `trainer_send_weights` broadcast) is replaced by one that hands the tensors to the
in-process server, `get_ip` returns 127.0.0.1, and `VLLMClient.init_communicator` is given the device "cuda" (no
index: TRL then calls no CUDA function) because it refuses a CPU device before it joins the group. Everything else
(TRL's client and its HTTP requests, `VLLMGeneration`, the weight iteration, the `/update_weights` protocol) is TRL's.

Colocate mode (`patch_trl(monkeypatch, engine=...)`): `vllm.LLM` and `vllm.SamplingParams` become `FakeLLM` and
`SamplingParams` here, with the interface `VLLMGeneration` calls (`generate(prompts, sampling_params=...)`,
`llm_engine...model.load_weights`, `reset_prefix_cache`), backed by the same engine; every call is recorded.

Sampling follows vLLM: logits / temperature, then top-k, top-p and min-p; the returned log-probs are those of the
processed distribution (`processed_logprobs`). A completion ends at an EOS token (kept in `token_ids`), at a stop
string (the token that completes it kept; the text cut after it with `include_stop_str_in_output`, before it
otherwise), or after `max_tokens`. A test may script the tokens instead of sampling them (`engine.script`); their
log-probs are still the model's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
from collections import namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import parse_qs, urlparse

import torch

MODEL_ID = "standin"
# The `/v1/completions` fields that are not sampling parameters.
COMPLETION_FIELDS = {"model", "prompt", "return_token_ids", "return_tokens_as_token_ids"}
CHAT_FIELDS = {"model", "messages", "return_token_ids", "return_tokens_as_token_ids", "top_logprobs", "tools",
               "tool_choice", "chat_template", "chat_template_kwargs"}  # fmt: skip
# Transfer-engine payloads as TRL builds them (`VLLMClient.init_communicator`, `update_named_params`).
INIT_INFO_KEYS = {"master_address", "master_port", "rank_offset", "world_size"}
UPDATE_INFO_KEYS = {"names", "dtype_names", "shapes"}


@dataclasses.dataclass
class Sampling:
    """The vLLM `SamplingParams` fields the stand-in honours, with vLLM's defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    logprobs: int | None = None  # None: no log-probs; 0: the sampled token's; N: also the N most likely
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None

    @classmethod
    def from_fields(cls, fields: dict, where: str) -> Sampling:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"{where}: the stand-in does not know the sampling field(s) {unknown} (known: "
                             f"{sorted(known)}).")  # fmt: skip
        params = cls(**{k: v for k, v in fields.items() if v is not None or k == "logprobs"})
        if isinstance(params.stop, str):
            params.stop = [params.stop]
        if params.repetition_penalty != 1.0:
            raise ValueError(f"{where}: repetition_penalty={params.repetition_penalty} is not implemented here.")
        if params.n < 1 or (params.max_tokens is not None and params.max_tokens < 1):
            raise ValueError(f"{where}: n={params.n} and max_tokens={params.max_tokens} must be >= 1 (vLLM's rule).")
        return params


@dataclasses.dataclass
class Completion:
    """One sampled completion, as vLLM's `CompletionOutput` holds it."""

    token_ids: list[int]
    logprobs: list[float]  # the processed log-prob of each sampled token
    top: list[dict[int, float]]  # per token, the `logprobs` most likely tokens and the sampled one
    text: str
    finish_reason: str  # "stop" or "length"
    stop_reason: str | None  # the stop string, or None for EOS and length


class Engine:
    """Generation with vLLM's sampling and stop rules, on a transformers causal LM (the tiny model on CPU).

    `script`, when set, is called as `script(prompt_ids, index)` (index: which of the prompt's n samples) and returns
    the token ids to emit instead of sampling them (sampling resumes after them), or None to sample; stop rules and
    `max_tokens` apply to scripted tokens too.
    """

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

        self.path = str(path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(self.path)
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.script = None
        self.lock = threading.Lock()
        self.generator = torch.Generator().manual_seed(0)

    def load_weights(self, weights) -> list[str]:
        """Copy `(name, tensor)` pairs into the model's parameters (names as `VLLMGeneration` sends them)."""
        params = dict(self.model.named_parameters())
        loaded = []
        with self.lock, torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise ValueError(f"weight {name!r} is not a parameter of the served model.")
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model's is "
                                     f"{tuple(params[name].shape)}.")  # fmt: skip
                params[name].copy_(tensor.to(params[name].dtype))
                loaded.append(name)
        return loaded

    @torch.no_grad()
    def complete(self, prompt_ids: list[int], params: Sampling) -> list[Completion]:
        """`params.n` completions of one prompt."""
        n, limit = params.n, params.max_tokens or 16
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else self.generator
        scripts = [self.script(list(prompt_ids), j) if self.script is not None else None for j in range(n)]
        with self.lock:
            out = self.model(input_ids=torch.tensor([list(prompt_ids)] * n), use_cache=True)
            tokens, logprobs, tops = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
            ends: list[tuple | None] = [None] * n
            for step in range(limit):
                logp = _processed_logprobs(out.logits[:, -1], params)  # (n, V)
                sampled = _sample(logp, params.temperature, generator)  # (n,)
                for j in range(n):
                    if ends[j] is not None:
                        continue
                    token = scripts[j][step] if scripts[j] is not None and step < len(scripts[j]) else None
                    token = int(sampled[j]) if token is None else int(token)
                    tokens[j].append(token)
                    logprobs[j].append(float(logp[j, token]))
                    tops[j].append(self._top(logp[j], token, params.logprobs))
                    ends[j] = self._stop(tokens[j], params)
                if all(e is not None for e in ends):
                    break
                last = sampled.new_tensor([t[-1] for t in tokens]).unsqueeze(1)  # (n, 1)
                out = self.model(input_ids=last, cache=out.cache, use_cache=True)
        completions = []
        for j in range(n):
            reason, stop, text = ends[j] or ("length", None, self._text(tokens[j]))
            completions.append(Completion(tokens[j], logprobs[j], tops[j], text, reason, stop))
        return completions

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)  # vLLM's default `skip_special_tokens=True`

    def _stop(self, ids: list[int], params: Sampling) -> tuple | None:
        if ids[-1] in self.eos:
            return "stop", None, self._text(ids)
        text = self._text(ids)
        for stop in params.stop or []:
            at = text.find(stop)
            if at >= 0:
                return "stop", stop, text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
        return None

    @staticmethod
    def _top(logp: torch.Tensor, token: int, k: int | None) -> dict[int, float]:
        top = {token: float(logp[token])}
        if k:
            values, ids = logp.topk(k)
            top.update({int(i): float(v) for i, v in zip(ids, values, strict=True)})
        return top


def _processed_logprobs(logits: torch.Tensor, params: Sampling) -> torch.Tensor:
    """(n, V) log-probs after vLLM's processing: temperature, top-k, top-p, min-p (greedy: the raw log-softmax)."""
    logits = logits.float()
    if params.temperature > 0:
        logits = logits / params.temperature
    if params.top_k and params.top_k > 0:
        kth = logits.topk(min(params.top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs > params.top_p  # tokens after the nucleus is full
        logits = logits.scatter(-1, order, ordered.masked_fill(outside, -math.inf))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, -math.inf)
    return logits.log_softmax(-1)


def _sample(logp: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logp.argmax(-1)
    return torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)


# ---------------------------------------------------------------------------------------------- the server
Request = namedtuple("Request", "method path body")


class StandinServer:
    """The routes `trl vllm-serve` answers for TRL's `VLLMClient`, on 127.0.0.1, in a thread of this process.

    `requests` records every request (method, path, JSON body); `responses` every `/v1/completions` answer, in order.
    `completions()` lists the `/v1/completions` bodies.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.requests: list[Request] = []
        self.responses: list[dict] = []
        self.loaded: list[list[str]] = []  # the parameter names of each weight update
        self._broadcast: queue.Queue = queue.Queue()
        self._transfer = None  # the init_info of the weight-transfer group, once initialised
        self._updating = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def _answer(self, method):
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else {}
                    if method == "GET":
                        body = {k: v[-1] for k, v in parse_qs(url.query).items()}
                    status, payload = server.handle(method, url.path, body)
                except Exception as error:  # a 400 is not retried by TRL's client (a 5xx would be, with back-off)
                    status, payload = 400, {"error": {"message": f"{type(error).__name__}: {error}",
                                                      "type": "BadRequestError"}}  # fmt: skip
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def reset(self) -> None:
        """Forget the recorded requests and the script (a connected client's transfer group stays)."""
        self.requests.clear()
        self.responses.clear()
        self.loaded.clear()
        self.engine.script = None

    def completions(self) -> list[dict]:
        return [r.body for r in self.requests if r.path == "/v1/completions"]

    def paths(self) -> list[str]:
        return [r.path for r in self.requests]

    # ---- routes
    def handle(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        self.requests.append(Request(method, path, body))
        routes = {
            ("GET", "/health"): lambda b: {},
            ("GET", "/v1/models"): lambda b: {"object": "list", "data": [{"id": MODEL_ID, "object": "model",
                                                                          "root": self.engine.path}]},
            ("GET", "/server_info"): self._server_info,
            ("GET", "/get_world_size"): lambda b: {"world_size": 1},
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/init_weight_transfer_engine"): self._init_transfer,
            ("POST", "/start_weight_update"): self._start_update,
            ("POST", "/update_weights"): self._update_weights,
            ("POST", "/finish_weight_update"): self._finish_update,
            ("POST", "/reset_prefix_cache"): lambda b: {"success": True},
        }  # fmt: skip
        route = routes.get((method, path))
        if route is None:
            return 404, {"detail": "Not Found"}
        return 200, route(body)

    def _server_info(self, body):
        config = self.engine.model.config
        return {"vllm_config": {
            "model_config": {"model": self.engine.path, "logprobs_mode": "processed_logprobs",
                             "max_model_len": config.max_position_embeddings},
            "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1},
            "weight_transfer_config": {"backend": "nccl"},
        }}  # fmt: skip

    def _completions(self, body):
        unknown = sorted(set(body) - COMPLETION_FIELDS - {f.name for f in dataclasses.fields(Sampling)})
        if unknown:
            raise ValueError(f"/v1/completions: unknown field(s) {unknown}.")
        prompts = body["prompt"]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = Sampling.from_fields({k: v for k, v in body.items() if k not in COMPLETION_FIELDS}, "/v1/completions")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for k, prompt in enumerate(prompts):
            ids = self.engine.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) \
                else list(prompt)  # fmt: skip
            for j, c in enumerate(self.engine.complete(ids, params)):
                choice = {"index": k * params.n + j, "text": c.text, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason, "logprobs": None}  # fmt: skip
                if params.logprobs is not None:
                    names = [self._token(t, as_ids) for t in c.token_ids]
                    choice["logprobs"] = {
                        "tokens": names, "token_logprobs": c.logprobs,
                        "top_logprobs": [{self._token(t, as_ids): v for t, v in top.items()} for top in c.top],
                    }  # fmt: skip
                if body.get("return_token_ids"):
                    choice["prompt_token_ids"], choice["token_ids"] = ids, c.token_ids
                choices.append(choice)
        response = {"object": "text_completion", "model": MODEL_ID, "choices": choices}
        self.responses.append(response)
        return response

    def _chat(self, body):
        unknown = sorted(set(body) - CHAT_FIELDS - {f.name for f in dataclasses.fields(Sampling)})
        if unknown:
            raise ValueError(f"/v1/chat/completions: unknown field(s) {unknown}.")
        if body.get("tool_choice", "none") != "none":
            raise ValueError(
                "/v1/chat/completions: the stand-in renders tools only (tool_choice='none', as TRL sends)."
            )
        fields = {k: v for k, v in body.items() if k not in CHAT_FIELDS}
        top = body.get("top_logprobs") or 0
        fields["logprobs"] = top if fields.get("logprobs") else None  # chat: `logprobs` is a bool, `top_logprobs` N
        params = Sampling.from_fields(fields, "/v1/chat/completions")
        ids = self.engine.tokenizer.apply_chat_template(
            body["messages"], tools=body.get("tools"), chat_template=body.get("chat_template"), tokenize=True,
            add_generation_prompt=True, return_dict=False, **(body.get("chat_template_kwargs") or {}),
        )  # fmt: skip
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for j, c in enumerate(self.engine.complete(list(ids), params)):
            logprobs = None
            if params.logprobs is not None:
                logprobs = {"content": [
                    {"token": self._token(t, as_ids), "logprob": lp,
                     "top_logprobs": [{"token": self._token(i, as_ids), "logprob": v} for i, v in top_.items()]}
                    for t, lp, top_ in zip(c.token_ids, c.logprobs, c.top, strict=True)
                ]}  # fmt: skip
            choices.append({"index": j, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "token_ids": c.token_ids})  # fmt: skip
        return {"object": "chat.completion", "model": MODEL_ID, "prompt_token_ids": list(ids), "choices": choices}

    def _token(self, token: int, as_ids: bool) -> str:
        return f"token_id:{token}" if as_ids else self.engine.tokenizer.convert_ids_to_tokens(token)

    def _init_transfer(self, body):
        info = body["init_info"]
        if not INIT_INFO_KEYS <= set(info) or info["world_size"] != 2 or info["rank_offset"] != 1:
            raise ValueError(f"init_info {info} is not a one-worker group with the trainer as rank 0.")
        self._transfer = info
        return {}

    def _start_update(self, body):
        if self._transfer is None:
            raise ValueError("start_weight_update before init_weight_transfer_engine.")
        self._updating = True
        return {}

    def _update_weights(self, body):
        # vLLM's workers block in the NCCL receive here; the stand-in waits for the fake broadcast's tensors.
        info = body["update_info"]
        if not self._updating or not UPDATE_INFO_KEYS <= set(info):
            raise ValueError(f"update_weights outside start/finish_weight_update, or without {UPDATE_INFO_KEYS}.")
        tensors = self._broadcast.get(timeout=60)
        sent = ([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                [list(t.shape) for _, t in tensors])  # fmt: skip
        if sent != (info["names"], info["dtype_names"], info["shapes"]):
            raise ValueError("the broadcast tensors are not the ones update_info announced.")
        self.loaded.append(self.engine.load_weights(tensors))
        return {}

    def _finish_update(self, body):
        self._updating = False
        return {}

    # ---- the fake NCCL group
    def nccl_engine(self):
        """Stands in for vLLM's `NCCLWeightTransferEngine` (static `trainer_init`, `trainer_send_weights`)."""
        server = self

        class _Engine:
            @staticmethod
            def trainer_init(init_info):
                return SimpleNamespace(server=server, init_info=dict(init_info), group=SimpleNamespace())

            @staticmethod
            def trainer_send_weights(iterator, trainer_args):
                tensors = [(name, tensor.detach().cpu().clone()) for name, tensor in iterator]
                trainer_args.group.server._broadcast.put(tensors)

        return _Engine


@dataclasses.dataclass
class SendWeightsArgs:
    """Stands in for vLLM's `NCCLTrainerSendWeightsArgs`."""

    group: object
    packed: bool = False


# ---------------------------------------------------------------------------------------------- colocate mode
Logprob = namedtuple("Logprob", "logprob rank decoded_token")
SAMPLING_PARAMS_FIELDS = {f.name for f in dataclasses.fields(Sampling)}


class SamplingParams:
    """Stands in for `vllm.SamplingParams`: keeps its keyword arguments; an unknown one is a TypeError, as in vLLM."""

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - SAMPLING_PARAMS_FIELDS)
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword argument(s) {unknown}.")
        self.kwargs = kwargs
        self.params = Sampling.from_fields(kwargs, "SamplingParams")


class FakeLLM:
    """Stands in for `vllm.LLM` in colocate mode, with the interface `VLLMGeneration` calls; records its calls."""

    def __init__(self, engine: Engine, **kwargs):
        self.init_kwargs = kwargs
        self.engine = engine
        self.calls: list[tuple[list, SamplingParams]] = []
        self.loaded: list[str] = []
        self.prefix_cache_resets = 0
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load_weights))
        max_len = kwargs.get("max_model_len") or engine.model.config.max_position_embeddings
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
            model_config=SimpleNamespace(max_model_len=max_len),
        )

    def _load_weights(self, weights):
        self.loaded += self.engine.load_weights([(n, t.detach().cpu()) for n, t in weights])

    def reset_prefix_cache(self):
        self.prefix_cache_resets += 1

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        params = sampling_params.params
        outputs = []
        for prompt in prompts:
            if set(prompt) != {"prompt_token_ids"}:
                raise NotImplementedError(f"the stand-in LLM takes token ids only, got {sorted(prompt)}.")
            results = self.engine.complete(prompt["prompt_token_ids"], params)
            outputs.append(SimpleNamespace(prompt_token_ids=list(prompt["prompt_token_ids"]), outputs=[
                SimpleNamespace(token_ids=c.token_ids, text=c.text, finish_reason=c.finish_reason,
                                logprobs=None if params.logprobs is None else [
                                    {t: Logprob(v, rank, None) for rank, (t, v) in
                                     enumerate(sorted(top.items(), key=lambda kv: -kv[1]), start=1)}
                                    for top in c.top])
                for c in results]))  # fmt: skip
        return outputs


# ---------------------------------------------------------------------------------------------- wiring
def patch_trl(monkeypatch, server: StandinServer | None = None, engine: Engine | None = None) -> None:
    """Let TRL's vLLM paths run here: against `server` (server mode), or with `FakeLLM` on `engine` (colocate mode).

    Patched for the test only (`monkeypatch`), never in the package; see the module docstring for what is faked.
    """
    from trl.generation import vllm_client, vllm_generation

    def available(min_version=None):
        return True

    monkeypatch.setattr(vllm_client, "is_vllm_available", available)
    monkeypatch.setattr(vllm_generation, "is_vllm_available", available)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    if server is not None:
        # vllm_client: `if _HAS_STATEFUL_TRAINER_ENGINE: ... elif is_vllm_available(): from
        # vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine`
        # and `from vllm.utils.network_utils import get_ip`, both evaluated at import: without vLLM these names are
        # absent, so they are set here.
        monkeypatch.setattr(vllm_client, "get_ip", lambda: "127.0.0.1", raising=False)
        monkeypatch.setattr(vllm_client, "NCCLWeightTransferEngine", server.nccl_engine(), raising=False)
        monkeypatch.setattr(vllm_client, "NCCLTrainerSendWeightsArgs", SendWeightsArgs, raising=False)
        # `init_communicator`: `if device.type != "cuda": raise NotImplementedError(...)`, then `if device.index is not
        # None: torch.cuda.set_device(device)`: "cuda" without an index passes the check and calls no CUDA function.
        original = vllm_client.VLLMClient.init_communicator
        monkeypatch.setattr(vllm_client.VLLMClient, "init_communicator",
                            lambda self, device=0: original(self, device="cuda"))  # fmt: skip
    if engine is not None:
        monkeypatch.setattr(vllm_generation, "LLM", lambda **kwargs: FakeLLM(engine, **kwargs), raising=False)
        monkeypatch.setattr(vllm_generation, "SamplingParams", SamplingParams, raising=False)
