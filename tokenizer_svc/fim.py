"""Fill-in-the-middle prompts as the served model was trained to read them.

A coder model learns FIM with its own control tokens and its own order of the pieces; the client
sends only text (the code before the cursor, the code after it, other files of the project) and
this module makes the prompt. Each family is one declaration below (its token strings, the order
of prefix and suffix, whether BOS opens the prompt, how a repository's files are laid out, and the
tokens that end a completion); which family a model is comes from its vocabulary, or from the GGUF
metadata's ``tokenizer.ggml.fim_*_token_id`` where the file has them. A model with no FIM tokens
gets ``FimUnavailable``, whose message names what is missing.

The layout puts what changes least first: the repository's files, then the current file's name,
then the code. ``layout`` returns the prompt as pieces (control token ids and text runs); the text
runs are encoded as plain text (a control token's string in client code stays text), each run
between two control tokens encoded whole, as the model card's one string would be.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The order a server lays FIM prompts out in where the request names none and the format takes
# both (``llmserve serve --fim-order``; docs/fill-in-the-middle.md has the measurement behind it).
DEFAULT_FIM_ORDER = "psm"

# The names a repository layout writes where the client gives none: llama-server's (b11434, its
# /infill prompt: the repository ``myproject``, the current file ``filename``). llama.vscode, the
# /infill client, names neither, so its prompt here is the one it gets from llama.cpp
# (docs/fill-in-the-middle.md, "The names a prompt gets").
DEFAULT_REPO_NAME = "myproject"
DEFAULT_FILE_NAME = "filename"

# GGUF metadata keys (llama.cpp's names): the current ones, then the older CodeLlama-era ones.
GGUF_KEYS = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "pad": ("tokenizer.ggml.fim_pad_token_id",),
    "rep": ("tokenizer.ggml.fim_rep_token_id",),
    "sep": ("tokenizer.ggml.fim_sep_token_id",),
    "eot": ("tokenizer.ggml.eot_token_id",),
}


@dataclass(frozen=True)
class FimFamily:
    """One family's FIM format, as its model card documents it.

    ``order``: "psm" (prefix, suffix, then the middle is generated) or "spm" (suffix first, the
    prefix last, and the middle continues it). ``repo``/``sep``: the repository-level tokens, with
    ``repo_text`` (after ``repo``) and ``file_text`` (after each ``sep``) as format strings; a family
    without ``sep`` cannot take other files. ``ends``: tokens after which the middle is complete.
    ``needs``: tokens that tell this family from another with the same FIM tokens."""

    name: str
    pre: str
    suf: str
    mid: str | None
    order: str = "psm"
    bos: bool = False
    repo: str | None = None
    sep: str | None = None
    repo_text: str = "{name}\n"
    file_text: str = "{path}\n{text}\n"
    current_file_text: str = "{path}\n"
    # Where the current file's path line goes: after its separator (Qwen2.5-Coder:
    # <|file_sep|>path\n<|fim_prefix|>prefix), or at the start of the prefix's run, after the
    # prefix token (StarCoder2: <file_sep><fim_prefix>path\nprefix).
    path_in_prefix: bool = False
    ends: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()


# One declaration per family; the first whose tokens are all in the vocabulary is the model's.
FAMILIES: tuple[FimFamily, ...] = (
    # Qwen2.5-Coder: <|repo_name|>name\n<|file_sep|>path\ncontent\n ... <|file_sep|>path\n
    # <|fim_prefix|>prefix<|fim_suffix|>suffix<|fim_middle|>
    FimFamily(
        "qwen2.5-coder",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        repo="<|repo_name|>",
        sep="<|file_sep|>",
        ends=("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|fim_prefix|>"),
        needs=("<|file_sep|>",),
    ),
    # CodeGemma: <bos><|fim_prefix|>prefix<|fim_suffix|>suffix<|fim_middle|>; files end at
    # <|file_separator|>.
    FimFamily(
        "codegemma",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        bos=True,
        sep="<|file_separator|>",
        ends=("<|file_separator|>", "<|fim_prefix|>", "<eos>"),
        needs=("<|file_separator|>",),
    ),
    # StarCoder2 (its paper, arXiv 2402.19173, section 5, the repository-context FIM format):
    # <repo_name>name<file_sep>path\ncontent<file_sep>...<file_sep><fim_prefix>path\nprefix
    # <fim_suffix>suffix<fim_middle>: the current file's path opens the prefix.
    FimFamily(
        "starcoder2",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        repo="<repo_name>",
        sep="<file_sep>",
        repo_text="{name}",
        file_text="{path}\n{text}",
        path_in_prefix=True,
        ends=("<|endoftext|>", "<file_sep>", "<fim_pad>", "<fim_prefix>"),
    ),
    # DeepSeek-Coder: <bos><｜fim▁begin｜>prefix<｜fim▁hole｜>suffix<｜fim▁end｜>
    FimFamily(
        "deepseek-coder",
        "<｜fim▁begin｜>",
        "<｜fim▁hole｜>",
        "<｜fim▁end｜>",
        bos=True,
        ends=("<|EOT|>", "<｜end▁of▁sentence｜>", "<｜fim▁begin｜>"),
    ),
    # CodeLlama: <s>▁<PRE> prefix ▁<SUF>suffix ▁<MID>, ending at ▁<EOT>.
    FimFamily("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", bos=True, ends=("▁<EOT>", "</s>")),
    # Codestral: <s>[SUFFIX]suffix[PREFIX]prefix (no middle token: the middle continues the prefix).
    FimFamily("codestral", "[PREFIX]", "[SUFFIX]", None, order="spm", bos=True, ends=("</s>",)),
    # A model with the common <|fim_*|> tokens and none of the above's repository tokens.
    FimFamily(
        "fim",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        ends=("<|endoftext|>", "<|fim_pad|>", "<|fim_prefix|>"),
    ),
)


class FimUnavailable(ValueError):
    """The served model cannot fill in the middle; the message says what is missing."""


@dataclass(frozen=True)
class FimSpec:
    """A family resolved against one model's vocabulary: token ids in place of strings."""

    family: FimFamily
    pre: int
    suf: int
    mid: int | None
    bos: int | None
    repo: int | None
    sep: int | None
    end_ids: tuple[int, ...]
    source: str = "vocabulary"  # or "gguf metadata"
    order: str = ""  # the server's default order ("psm", "spm"); "" is the family's own

    @property
    def orders(self) -> tuple[str, ...]:
        """The orders this format can lay a prompt out in: both where it has a middle token
        (the middle token closes either order), else only the family's own."""
        return ("psm", "spm") if self.mid is not None else (self.family.order,)

    def resolve_order(self, asked: str = "") -> str:
        """The order a request is laid out in: the one it asks for, else the server's, else the
        family's. Raises ``FimUnavailable`` for an order the format cannot take."""
        order = asked or self.order or self.family.order
        if order not in ("psm", "spm"):
            raise FimUnavailable(f'the order must be "psm" or "spm", not {order!r}')
        if order not in self.orders:
            raise FimUnavailable(
                f"the served model's FIM format ({self.family.name}) has no middle token: "
                f"it takes only the {self.family.order} order"
            )
        return order

    @property
    def takes_files(self) -> bool:
        return self.sep is not None


@dataclass
class FimInput:
    prefix: str
    suffix: str = ""
    files: list[tuple[str, str]] = field(default_factory=list)  # (path, text) of other files
    path: str = ""  # the current file's path (repository layout only)
    repo_name: str = ""
    middle: str = ""  # text already chosen after the cursor (llama.cpp's `prompt`)
    order: str = ""  # "psm", "spm", or "" for the server's default (FimSpec.resolve_order)


@dataclass(frozen=True)
class Text:
    """A run of client text between two control tokens; ``roles`` says what it holds, for the
    cuts (a prefix is cut from its start, a suffix from its end). ``head``: the run's start that a
    cut keeps (StarCoder2's current-file path line before its prefix)."""

    text: str
    roles: frozenset[str]
    head: str = ""


def _describe_missing() -> str:
    seen: dict[str, list[str]] = {}
    for f in FAMILIES:
        if f.name != "fim":
            seen.setdefault(f.pre, []).append(f.name)
    return ", ".join(f"{tok} ({' / '.join(names)})" for tok, names in seen.items())


def find_fim(
    token_to_id, bos_id: int | None, gguf_ids: dict[str, int] | None = None, id_to_token=None
) -> FimSpec:
    """The model's FIM format. ``token_to_id(str) -> int | None`` looks the vocabulary up;
    ``gguf_ids``: the metadata's ids by role (``read_gguf_fim_ids``), which win over the
    vocabulary; ``id_to_token`` names them. Raises ``FimUnavailable``."""
    gguf_ids = gguf_ids or {}
    if "pre" in gguf_ids and "suf" in gguf_ids:
        pre_tok = id_to_token(gguf_ids["pre"]) if id_to_token else None
        family = next((f for f in FAMILIES if f.pre == pre_tok), None)
        if family is None:  # ids without a family we declare: the common PSM layout
            family = FimFamily("gguf", pre_tok or "", "", None if "mid" not in gguf_ids else "")
        return _resolve(family, token_to_id, bos_id, gguf_ids, "gguf metadata")
    partial: list[str] = []
    for f in FAMILIES:
        wanted = [f.pre, f.suf, *([f.mid] if f.mid else []), *f.needs]
        missing = [t for t in wanted if token_to_id(t) is None]
        if not missing:
            return _resolve(f, token_to_id, bos_id, {}, "vocabulary")
        if token_to_id(f.pre) is not None and f.name == "fim":
            partial.append(f"it has {f.pre} but not {', '.join(missing)}")
        elif token_to_id(f.pre) is not None and not f.needs:
            partial.append(f"it has {f.pre} ({f.name}) but not {', '.join(missing)}")
    if partial:
        raise FimUnavailable("the served model cannot fill in the middle: " + "; ".join(partial))
    raise FimUnavailable(
        "the served model has no fill-in-the-middle tokens: its vocabulary has none of "
        f"{_describe_missing()}, and its GGUF metadata no tokenizer.ggml.fim_pre_token_id"
    )


def _resolve(f: FimFamily, token_to_id, bos_id, gguf_ids: dict[str, int], source: str) -> FimSpec:
    def tid(role: str, tok: str | None) -> int | None:
        if role in gguf_ids:
            return gguf_ids[role]
        return token_to_id(tok) if tok else None

    ends = [token_to_id(t) for t in f.ends]
    for role in ("eot", "pad", "sep", "rep"):
        if role in gguf_ids:
            ends.append(gguf_ids[role])
    end_ids = tuple(dict.fromkeys(i for i in ends if i is not None))
    return FimSpec(
        family=f,
        pre=tid("pre", f.pre),
        suf=tid("suf", f.suf),
        mid=tid("mid", f.mid),
        bos=bos_id if f.bos else None,
        repo=tid("rep", f.repo),
        sep=tid("sep", f.sep),
        end_ids=end_ids,
        source=source,
    )


def read_gguf_fim_ids(path) -> dict[str, int]:
    """The FIM token ids a GGUF file's metadata declares, by role ({} where it declares none).
    Read with ``CompactReader``: the package's own reader parsed the whole vocabulary into numpy
    arrays a string first (a Qwen2.5 file: 469 MiB of Python objects in the gateway at its start)."""
    from engine_svc.models.gguf_metadata import CompactReader

    reader = CompactReader(str(path))
    out: dict[str, int] = {}
    for role, keys in GGUF_KEYS.items():
        for key in keys:
            f = reader.fields.get(key)
            if f is not None:
                out[role] = int(f.contents())
                break
    return out


def layout(spec: FimSpec, inp: FimInput) -> list[int | Text]:
    """The prompt as control token ids and text runs, in the family's order. Other files need a
    family with a file separator (``FimUnavailable`` otherwise)."""
    f = spec.family
    out: list[int | Text] = []
    head = ""
    if spec.bos is not None:
        out.append(spec.bos)
    if inp.files:
        if spec.sep is None:
            raise FimUnavailable(
                f"the served model's FIM format ({f.name}) has no file separator token: "
                "other files cannot be given; put what matters in the prefix"
            )
        if spec.repo is not None:
            out += [
                spec.repo,
                Text(f.repo_text.format(name=inp.repo_name or DEFAULT_REPO_NAME), frozenset({"repo"})),
            ]
        for path, text in inp.files:
            out += [spec.sep, Text(f.file_text.format(path=path, text=text), frozenset({"files"}))]
        if spec.family.repo is not None:
            # The current file's own separator line opens the code, as in training: the model
            # card's repository layout always has it, and without it the prefix read as more of
            # the last other file (measured in docs/fill-in-the-middle.md). No path given:
            # llama-server's placeholder name.
            out.append(spec.sep)
            path = inp.path or DEFAULT_FILE_NAME
            if f.path_in_prefix:
                head = f.current_file_text.format(path=path)
            else:
                out.append(Text(f.current_file_text.format(path=path), frozenset({"path"})))
    prefix = Text(head + inp.prefix, frozenset({"prefix"}), head=head)
    # SPM puts the suffix before the prefix: a keystroke changes the prompt's tail only (the end
    # of the prefix), where PSM also recomputes the suffix after it. With a middle token (llama.cpp's
    # --spm-infill) the prompt ends with it and the middle after it, as in PSM; without one
    # (Codestral) the middle continues the prefix.
    if spec.resolve_order(inp.order) == "spm":
        out += [spec.suf, Text(inp.suffix, frozenset({"suffix"}))]
        if spec.mid is None:
            out += [spec.pre, Text(inp.prefix + inp.middle, frozenset({"prefix", "middle"}))]
            return _drop_empty(out)
        out += [spec.pre, prefix, spec.mid]
        out.append(Text(inp.middle, frozenset({"middle"})))
        return _drop_empty(out)
    out += [spec.pre, prefix]
    out += [spec.suf, Text(inp.suffix, frozenset({"suffix"}))]
    if spec.mid is not None:
        out.append(spec.mid)
    out.append(Text(inp.middle, frozenset({"middle"})))
    return _drop_empty(out)


def _drop_empty(pieces: list[int | Text]) -> list[int | Text]:
    return [p for p in pieces if not (isinstance(p, Text) and not p.text)]


@dataclass
class Cut:
    """What ``assemble`` cut: tokens dropped from the prefix's start and the suffix's end, and
    whole files left out."""

    prefix_tokens: int = 0
    suffix_tokens: int = 0
    files: int = 0


def assemble(
    pieces: list[int | Text],
    encoded: dict[int, list[int]],
    room: int | None,
    step: int = 16,
    heads: dict[int, list[int]] | None = None,
) -> tuple[list[int], Cut]:
    """The prompt's token ids: ``encoded[i]`` is text piece ``i``'s ids. With ``room`` (the most
    prompt tokens there is space for), a prompt over it is cut where a keystroke later still cuts
    it the same way: the suffix keeps at most a quarter of the room (its start, the code right
    after the cursor); other files are left out, first ones first, while the prefix would keep
    less than half of the room; then the prefix loses its start, in whole multiples of ``step``
    tokens (the cut moves only when the prefix grows past the next multiple, so the tokens before
    the cursor keep their positions, and the prefix cache keeps matching, from one keystroke to
    the next). A prefix run with a ``head`` keeps it through a cut: ``heads[i]`` is the head's
    ids, put back before what is left of the run after the head's length and the cut."""
    ids = {i: list(encoded.get(i, [])) for i, p in enumerate(pieces) if isinstance(p, Text)}
    cut = Cut()
    skip: set[int] = set()  # the separators of left-out files

    def total() -> int:
        return sum(1 if isinstance(p, int) else len(ids[i]) for i, p in enumerate(pieces) if i not in skip)

    if room is not None and total() > room:
        step = max(1, step)
        for i, p in enumerate(pieces):
            if isinstance(p, Text) and "suffix" in p.roles:
                keep = max(room // 4 // step * step, 0)
                if len(ids[i]) > keep:
                    cut.suffix_tokens += len(ids[i]) - keep
                    ids[i] = ids[i][:keep]
        prefix_at = [i for i, p in enumerate(pieces) if isinstance(p, Text) and "prefix" in p.roles]
        prefix_len = sum(len(ids[i]) for i in prefix_at)
        file_pieces = [i for i, p in enumerate(pieces) if isinstance(p, Text) and "files" in p.roles]
        for i in file_pieces:
            over = total() - room
            if over <= 0 or prefix_len - over >= min(prefix_len, room // 2):
                break
            ids[i] = []
            if i > 0 and isinstance(pieces[i - 1], int):  # a left-out file takes its separator
                skip.add(i - 1)
            cut.files += 1
        over = total() - room
        if over > 0 and prefix_at:
            i = prefix_at[0]
            head = (heads or {}).get(i, []) if pieces[i].head else []
            drop = min(-(-over // step) * step, len(ids[i]) - len(head))
            cut.prefix_tokens = drop
            ids[i] = head + ids[i][len(head) + drop :]
    out: list[int] = []
    for i, p in enumerate(pieces):
        if i not in skip:
            out += [p] if isinstance(p, int) else ids[i]
    return out, cut


def build_ids(spec: FimSpec, inp: FimInput, encode, room: int | None = None, step: int = 16) -> list[int]:
    """The prompt, with ``encode(text) -> ids`` (plain text, no special tokens added): what the
    gateway does with its tokenizer workers, in one call (tests, the offline API)."""
    pieces = layout(spec, inp)
    encoded = {i: encode(p.text) for i, p in enumerate(pieces) if isinstance(p, Text)}
    heads = {i: encode(p.head) for i, p in enumerate(pieces) if isinstance(p, Text) and p.head}
    return assemble(pieces, encoded, room, step, heads)[0]
