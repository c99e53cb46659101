"""What a command serves and how it logs: `ModelRefConfig` (the model and the names
clients ask for) and `LogConfig`; flags derived by `wsllm.config.add_arguments`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelRefConfig:
    """Which model a process serves and under which names: `serve` and `engine` load
    it, a gateway reads its tokenizer (no weights). `serve` takes several."""

    model: list[str] = field(
        default_factory=list,
        metadata={
            "help": "HF dir, .gguf file or hub id (default SmolLM2); `serve` takes it more than once, one engine per model"
        },
    )
    model_name: list[str] = field(
        default_factory=list,
        metadata={
            "help": "the id clients ask for; given more than once, the others are aliases (one --model only); default from the model"
        },
    )

    def __post_init__(self) -> None:
        if self.model_name and len(self.model) > 1:
            raise ValueError("--model-name names one model: give it with a single --model")
        if len(set(self.model)) != len(self.model):
            raise ValueError(f"--model is given twice for the same model: {self.model}")

    @property
    def served_name(self) -> str | None:
        return self.model_name[0] if self.model_name else None

    @property
    def aliases(self) -> list[str]:
        return self.model_name[1:]


@dataclass(slots=True)
class LogConfig:
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})

    def __post_init__(self) -> None:
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
