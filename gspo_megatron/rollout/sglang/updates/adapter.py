"""`lora_sync=adapter`: a LoRA policy's adapters loaded through SGLang's LoRA API
(docs/LORA.md, "Weight sync"). Per version the sender writes a PEFT adapter directory
(`adapter_model.safetensors` + `adapter_config.json`) under rollout.sglang.disk_dir, then on
every live server: /load_lora_adapter under the version's own name (SGLang refuses a name
already loaded), /update_weight_version (the samples' weight_version, which the stale-answer
check reads), and /unload_lora_adapter of the previous name (SGLang waits for the requests using
it). Generation names the current adapter in each /generate (`lora_path`).

A directory stays one version past its unloading: SGLang reloads an unloaded name on a late
request naming it, from its directory."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gspo_megatron import files
from gspo_megatron.checkpoint import lora_export
from gspo_megatron.rollout.sglang.updates.base import WeightUpdater
from gspo_megatron.rollout.sglang.updates.session import drop_failed

if TYPE_CHECKING:
    from gspo_megatron.event_loop import LoopThread
    from gspo_megatron.rollout.base import WeightSource
    from gspo_megatron.rollout.sglang.client import SGLangClient
    from gspo_megatron.rollout.sglang.config import SGLangEngineConfig
    from gspo_megatron.rollout.sglang.protocol import SGLangError
    from gspo_megatron.rollout.sglang.servers import ServerInfos


@dataclass(frozen=True)
class LoRAServing:
    """What a server needs to serve the adapters: `--enable-lora`, `--max-lora-rank` >= the
    rank and `--lora-target-modules` covering the adapted modules (SGLang sizes its LoRA memory
    pool by them at start-up; an adapter outside them is refused when it loads)."""

    rank: int
    target_modules: tuple[str, ...]

    @classmethod
    def of(cls, peft_config: dict) -> LoRAServing:
        return cls(int(peft_config["r"]), tuple(peft_config["target_modules"]))

    def launch_args(self) -> list[str]:
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(self.rank),
            "--lora-target-modules",
            *self.target_modules,
        ]

    def refusal(self, url: str, info: dict) -> str | None:
        """Why the server at `url` (its /server_info) cannot serve the adapters, or None."""
        key = "rollout.sglang.lora_sync=adapter"
        if not info.get("enable_lora"):
            return f"{key}: the SGLang server at {url} was started without --enable-lora"
        if int(info.get("dp_size") or 1) > 1:
            return (
                f"{key}: the SGLang server at {url} has dp_size {info['dp_size']}; SGLang "
                "refuses dynamic LoRA loading with data-parallel replicas"
            )
        max_rank = info.get("max_lora_rank")
        if max_rank is not None and int(max_rank) < self.rank:
            return (
                f"{key}: the SGLang server at {url} has --max-lora-rank {max_rank}, below "
                f"lora.rank={self.rank}"
            )
        modules = info.get("lora_target_modules")
        if modules is not None and "all" not in modules:
            missing = sorted(set(self.target_modules) - set(modules))
            if missing:
                return (
                    f"{key}: the SGLang server at {url} has --lora-target-modules "
                    f"{' '.join(modules)}, without {', '.join(missing)} (lora.targets)"
                )
        return None


PREFIX = "gspo_v"  # an adapter's name: PREFIX + its version


def adapter_name(version: int) -> str:
    """The name a version's adapter is loaded under (and `lora_path` of its /generate)."""
    return f"{PREFIX}{version}"


def _versions(loaded_adapters: dict | None) -> set[int]:
    """The versions of our adapters among those a /load_lora_adapter answer lists (SGLang
    loads an unloaded one again when a late request names it)."""
    names = (loaded_adapters or {}).keys()
    return {int(n.removeprefix(PREFIX)) for n in names if re.fullmatch(PREFIX + r"\d+", n)}


class AdapterUpdater(WeightUpdater):
    """Loads each version's adapter; keeps which adapters each server holds, to unload the
    older ones (again at the next update, where an unload failed)."""

    def __init__(
        self, cfg: SGLangEngineConfig, client: SGLangClient, loop: LoopThread, infos: ServerInfos
    ) -> None:
        super().__init__(cfg, client, loop, infos)
        assert cfg.disk_dir, "backend.check: lora_sync=adapter needs rollout.sglang.disk_dir"
        self.root = Path(cfg.disk_dir)
        for _ in files.remove_temporaries(self.root, only_dead_writers=True):
            pass  # adapters a killed writer of this host left half written
        self.held: dict[str, set[int]] = {}  # url -> the versions of the adapters it holds
        self._written: list[int] = []  # versions with a directory, oldest first
        self.current: str | None = None  # the adapter /generate names (None: the base)

    def directory(self, version: int) -> Path:
        return self.root / f"adapter_v{version}"

    def _write(self, source: WeightSource, version: int) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, object] = {}
        for bucket in source.buckets(self.cfg.bucket_bytes):
            for name, t in bucket:
                tensors[lora_export.PEFT_PREFIX + name] = t.detach().contiguous().cpu()
        if not tensors:
            raise ValueError("the LoRA source yielded no adapter tensors")
        self.root.mkdir(parents=True, exist_ok=True)
        with files.staged(self.directory(version)) as tmp:
            tmp.mkdir()
            save_file(tensors, str(tmp / lora_export.ADAPTER_FILE), metadata={"format": "pt"})
            lora_export.write_adapter_config(tmp, source.peft_config)
        self._written.append(version)

    def update(
        self,
        source: WeightSource,
        version: int,
        live: list[str],
        failures: dict[str, SGLangError],
    ) -> None:
        if version in self._written:
            for _ in source.buckets(self.cfg.bucket_bytes):
                pass  # the source's collectives still need this rank
        else:
            self._write(source, version)
        name = adapter_name(version)
        fresh = [u for u in live if version not in self.held.setdefault(u, set())]
        load = {"lora_name": name, "lora_path": str(self.directory(version))}
        answers = self._post_each("/load_lora_adapter", dict.fromkeys(fresh, load), live, failures)
        for url in fresh:
            if url in live:  # loaded, whatever happens next (a name loads once)
                self.held[url] = _versions(answers[url].get("loaded_adapters")) | {version}
        tag = {"new_version": str(version), "abort_all_requests": False}  # keep those running
        self._post_each("/update_weight_version", dict.fromkeys(live, tag), live, failures)
        if live:
            self.current = name
        older = {u: sorted(self.held[u] - {version}) for u in live}
        while unloading := {u: vs.pop(0) for u, vs in older.items() if vs}:  # one per server
            bodies = {u: {"lora_name": adapter_name(v)} for u, v in unloading.items()}
            self._post_each("/unload_lora_adapter", bodies, live, failures)
            for url, v in unloading.items():
                if url in live:
                    self.held[url].discard(v)
        self._clean()

    def _post_each(
        self, route: str, bodies: dict, live: list[str], failures: dict[str, SGLangError]
    ) -> dict:
        answers = self.loop.run(
            self.client.post_each(route, bodies, timeout_s=self.cfg.weight_update_timeout_s)
        )
        drop_failed(route, answers, live, failures)
        return answers

    def _clean(self) -> None:
        """Directories older than the one before the oldest adapter a server holds go (a late
        request naming an unloaded adapter makes SGLang load it again from its directory)."""
        oldest = min((min(vs) for vs in self.held.values() if vs), default=None)
        if oldest is None:
            return
        older = [v for v in self._written if v < oldest]
        for v in older[:-1]:
            shutil.rmtree(self.directory(v), ignore_errors=True)
            self._written.remove(v)

    def forget(self, url: str) -> None:
        self.held.pop(url, None)  # a restarted server holds the base alone
