"""WebShop in text mode behind the `TextEnv` protocol: local BM25 search, the official reward.

Data: a folder with WebShop's three files, in their official schema (`docs/environments.md` says how to
get them; `qevolve webshop-data` writes a small synthetic catalogue in the same schema):
- `items_shuffle_1000.json`: the products (asin, name, category, query, product_category, pricing,
  small_description, full_description, customization_options, ...);
- `items_ins_v2_1000.json`: asin -> {"attributes": [...], ...};
- `items_human_ins.json`: asin -> [{"instruction", "instruction_attributes", "instruction_options"}, ...].

Loading follows WebShop's `load_products`/`get_human_goals`: each product's price is drawn within its
listed range and each goal's price ceiling from the ten-dollar steps above it, then the goals are
shuffled, all with WebShop's seed 233, and a task is a goal's index in that list. The standard splits
(`<splits>/webshop/{train,test}_indices.json`) index the goals built from the official files; a data
folder with its own `splits/` (the synthetic one) uses those instead.

Pages and actions as in WebShop's text mode: `search[query]` on the search page; `click[x]` on any
listed button (`back to search`, `next >`, `< prev`, a product's asin, an option, `description`,
`features`, `reviews`, `buy now`). Ten results a page, at most 50. `buy now` ends the episode with the
official reward (`reward`); success is a reward of 1. Anything else is rejected ("Invalid action!").
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from qevolve.environments import ENVIRONMENTS
from qevolve.envs.base import Observation, Step, Task, check_types, read_split_file, splits_dir
from qevolve.errors import UserError

FILES = ("items_shuffle_1000.json", "items_ins_v2_1000.json", "items_human_ins.json")
SPEC = ENVIRONMENTS["webshop"]
SEED = 233
PRICE_RANGE = [10.0 * i for i in range(1, 100)]
PAGE_SIZE, MAX_RESULTS = 10, 50
INVALID = "Invalid action!"
SUB_PAGES = ("description", "features", "reviews")
# WebShop's colour list (web_agent_site/engine/normalize.py): an option containing one of these is compared
# as the first one it contains
COLORS = """alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown burgundy camel
camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac copper coral cranberry cream crystal
dark denim eggplant elephant espresso fuchsia gold granite grape graphite grass gray green grey heather indigo ivory ivy
khaki lavender lemon leopard light lilac lime magenta maroon mauve merlot midnight mint mocha multicolor mushroom
mustard natural navy nude olive orange peach pewter pink plum purple rainbow red rose royal rust sand sapphire seashell
silver skull slate steel stone stonewash sunflower tan taupe teal tiger turquoise violet walnut wheat white wine
yellow""".split()
# Words that are not product types, for the title match (WebShop parses nouns with spaCy, see `_type_words`)
_NOT_TYPE = set(
    """a an and the for with of in on to by from at or as is are be this that these those it its your you our
new pack set size color inch inches ounce ounces oz count pcs piece pieces men women mens womens kids unisex large small
medium x xl xxl s m l ft cm mm ml lb lbs""".split()
)


class WebShopDataError(UserError, ValueError):
    hint = (
        "docs/environments.md says where WebShop's data comes from; `qevolve webshop-data <folder>` writes a "
        "synthetic catalogue"
    )


def data_dir(configured: str | Path | None = None) -> Path:
    folder = Path(configured or os.environ.get("WEBSHOP_DATA") or "")
    if not str(folder) or str(folder) == ".":
        raise WebShopDataError(
            "WebShop data folder not set: set env.data_dir or WEBSHOP_DATA to the folder with "
            f"{', '.join(FILES)} (`qevolve webshop-data <folder>` writes a synthetic one)"
        )
    missing = [f for f in FILES if not (folder / f).is_file()]
    if missing:
        raise WebShopDataError(f"{folder}: missing {', '.join(missing)}")
    return folder


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise WebShopDataError(f"{path}: not valid JSON: {err}") from None


def _field(record: dict, key: str, kind, path: Path, where: str):
    if key not in record:
        raise WebShopDataError(f"{path}: {where}: missing field {key!r}")
    value = record[key]
    if not isinstance(value, kind):
        raise WebShopDataError(
            f"{path}: {where}: field {key!r} is {type(value).__name__}; expected {getattr(kind, '__name__', kind)}"
        )
    return value


@dataclass
class Product:
    asin: str
    title: str
    category: str
    query: str
    product_category: str
    bullets: list[str]
    description: str
    pricing: list[float]
    price: float
    options: dict[str, list[str]]
    attributes: list[str]
    rating: str = "N.A."

    @property
    def price_tag(self) -> str:
        return f"${self.pricing[0]}" if len(self.pricing) == 1 else f"${self.pricing[0]} to ${self.pricing[1]}"


@dataclass
class Catalogue:
    products: dict[str, Product]
    goals: list[dict]
    folder: Path


def _parse_pricing(raw, path: Path, where: str) -> list[float]:
    if not raw:
        return [100.0]
    if not isinstance(raw, str):
        raise WebShopDataError(
            f"{path}: {where}: field 'pricing' is {type(raw).__name__}; expected a string like '$12.99'"
        )
    prices = [float(re.sub(r"[^\d.]", "", p)) for p in raw.split("$")[1:] if re.sub(r"[^\d.]", "", p)]
    return prices[:2] or [100.0]


@lru_cache(maxsize=2)
def load_catalogue(folder: str) -> Catalogue:
    """Products and goals from WebShop's files, as WebShop's own loader builds them (module docstring)."""
    folder = data_dir(folder)
    items_path, attrs_path, human_path = (folder / f for f in FILES)
    items, attrs, human = _read(items_path), _read(attrs_path), _read(human_path)
    if not isinstance(items, list):
        raise WebShopDataError(f"{items_path}: expected a list of products")
    for path, table in ((attrs_path, attrs), (human_path, human)):
        if not isinstance(table, dict):
            raise WebShopDataError(f"{path}: expected an object keyed by asin")
    rng = random.Random(SEED)
    products: dict[str, Product] = {}
    for i, p in enumerate(items):
        where = f"product {i}"
        asin = str(_field(p, "asin", str, items_path, where))
        if asin == "nan" or len(asin) > 10 or asin in products:
            continue
        options = {}
        for name, values in (p.get("customization_options") or {}).items():
            if values:
                options[name.lower()] = [
                    str(_field(v, "value", str, items_path, f"{where} option {name!r}"))
                    .strip()
                    .replace("/", " | ")
                    .lower()
                    for v in values
                ]
        pricing = _parse_pricing(p.get("pricing"), items_path, where)
        price = rng.uniform(*pricing[:2]) if len(pricing) > 1 else pricing[0]
        products[asin] = Product(
            asin=asin,
            title=_field(p, "name", str, items_path, where),
            category=_field(p, "category", str, items_path, where),
            query=_field(p, "query", str, items_path, where).lower().strip(),
            product_category=p.get("product_category") or "",
            description=p.get("full_description") or "",
            bullets=[b.strip() for b in (p.get("small_description") or "").strip().split("\n") if b.strip()],
            pricing=pricing,
            price=price,
            options=options,
            attributes=(attrs.get(asin) or {}).get("attributes") or ["DUMMY_ATTR"],
        )
    goals = []
    for asin, product in products.items():
        for j, ins in enumerate(human.get(asin) or []):
            where = f"{asin} instruction {j}"
            attributes = _field(ins, "instruction_attributes", list, human_path, where)
            if not attributes:
                continue
            ceilings = [p for p in PRICE_RANGE if p > product.price][:4]
            if len(ceilings) >= 2:
                _, upper = sorted(rng.sample(ceilings, 2))
                price_text = f", and price lower than {upper:.2f} dollars"
            else:
                upper, price_text = 1_000_000.0, ""
            goals.append(
                {
                    "asin": asin,
                    "category": product.category,
                    "query": product.query,
                    "name": product.title,
                    "product_category": product.product_category,
                    "instruction_text": _field(ins, "instruction", str, human_path, where).strip(".") + price_text,
                    "attributes": attributes,
                    "price_upper": upper,
                    "goal_options": _field(ins, "instruction_options", list, human_path, where),
                }
            )
    rng.shuffle(goals)
    return Catalogue(products, goals, folder)


@lru_cache(maxsize=2)
def _index(folder: str):
    import bm25s

    catalogue = load_catalogue(folder)
    asins = list(catalogue.products)
    docs = [
        " ".join([p.title, p.description, " ".join(p.bullets), " ".join(v for vs in p.options.values() for v in vs)])
        for p in catalogue.products.values()
    ]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(docs, stopwords="en", return_ids=False, show_progress=False), show_progress=False)
    return retriever, asins


def search(folder: str, query: str) -> list[str]:
    """The asins of the (at most 50) products BM25 ranks above zero for `query`."""
    import bm25s

    retriever, asins = _index(folder)
    tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
    if not tokens[0]:
        return []
    found, scores = retriever.retrieve(tokens, k=min(MAX_RESULTS, len(asins)), show_progress=False)
    return [asins[i] for i, s in zip(found[0], scores[0]) if s > 0]


def list_tasks(folder: str, split: str) -> list[Task]:
    if split not in SPEC.splits:
        raise ValueError(f"unknown WebShop split {split!r}; expected one of {SPEC.splits}")
    catalogue = load_catalogue(folder)
    own = catalogue.folder / "splits"
    path = (own if own.is_dir() else splits_dir("webshop")) / f"{split}_indices.json"
    indices = read_split_file(path)
    too_big = [i for i in indices if not isinstance(i, int) or not 0 <= i < len(catalogue.goals)]
    if too_big:
        raise WebShopDataError(
            f"{path}: goal indices {too_big[:3]}... are outside the {len(catalogue.goals)} goals of "
            f"{catalogue.folder}; the standard splits index the goals of the official files"
        )
    return [Task(id=str(i), split=split, type=catalogue.goals[i]["category"]) for i in indices]


# ---- the official reward (WebShop's web_agent_site/engine/goal.py) ----


def _type_words(title: str) -> set[str]:
    """The product-type words of a title. WebShop keeps spaCy's noun tags; its English model cannot be
    installed offline, so this keeps the alphabetic words that are not stop words, sizes or units."""
    return {w for w in re.findall(r"[a-z]+", title.lower()) if len(w) > 1 and w not in _NOT_TYPE}


def _normalize_color(option: str) -> str:
    return next((c for c in COLORS if c in option), option)


def reward(product: Product, goal: dict, options: dict[str, str]) -> float:
    """WebShop's reward for buying `product` with `options` (option name -> chosen value) for `goal`:
    (matched attributes + matched options + price within the ceiling) / (attributes + options + 1),
    times the product-type factor."""
    from rapidfuzz import fuzz

    # product type: same search query, shared category path, or title words
    category_match = (
        len(
            {c.strip() for c in product.product_category.split("›")}
            & {c.strip() for c in goal["product_category"].split("›")}
        )
        >= 2
    )
    desired = _type_words(goal["name"])
    title_score = len(_type_words(product.title) & desired) / len(desired) if desired else 0.2
    r_type = 1.0 if (product.query == goal["query"] or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    # attributes: fuzzy in the product's attribute list, or verbatim in its text
    text = " ".join([product.title, " ".join(product.bullets), product.description]).lower()
    attrs = sum(
        any(fuzz.token_set_ratio(p, g) > 85 for p in product.attributes) or g in text for g in goal["attributes"]
    )
    chosen = [_normalize_color(o) for o in options.values()]
    opts = sum(any(fuzz.token_set_ratio(p, _normalize_color(g)) > 85 for p in chosen) for g in goal["goal_options"])
    price_ok = product.price <= goal["price_upper"]
    return r_type * (attrs + opts + price_ok) / (len(goal["attributes"]) + len(goal["goal_options"]) + 1)


def _join(parts: list[str]) -> str:
    return " [SEP] ".join(parts)


class WebShopEnv:
    """One shopping session at a time over a catalogue loaded once per process."""

    def __init__(self, data: str | Path | None = None, expert: str | None = None):
        self._configured = str(data) if data else None
        self._folder: str | None = None
        self.expert = expert
        self._goal: dict | None = None

    @property
    def folder(self) -> str:
        """The data folder, checked once (every page render reads the catalogue through it)."""
        if self._folder is None:
            self._folder = str(data_dir(self._configured))
        return self._folder

    def tasks(self, split: str) -> list[Task]:
        return list_tasks(self.folder, split)

    def reset(self, task: Task) -> Observation:
        catalogue = load_catalogue(self.folder)
        if not task.id.isdigit() or int(task.id) >= len(catalogue.goals):
            raise ValueError(f"WebShop task id {task.id!r}: expected a goal index below {len(catalogue.goals)}")
        self._goal = catalogue.goals[int(task.id)]
        self._page: tuple = ("search",)
        self._history: list[tuple] = []
        self._results: list[str] = []
        self._chosen: dict[str, str] = {}
        self._expert_pages = 0
        return Observation(
            instruction=self._goal["instruction_text"], text=self._render(), admissible=self._admissible()
        )

    # pages: ("search",), ("results", page), ("item", asin), ("sub", asin, name)
    def _buttons(self) -> list[str]:
        kind = self._page[0]
        if kind == "results":
            page = self._page[1]
            more = (page + 1) * PAGE_SIZE < len(self._results)
            return (
                ["back to search"]
                + (["< prev"] if page else [])
                + (["next >"] if more else [])
                + [a.lower() for a in self._results[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]]
            )
        if kind == "item":
            product = load_catalogue(self.folder).products[self._page[1]]
            return (
                ["back to search", "< prev"]
                + [v for vs in product.options.values() for v in vs]
                + list(SUB_PAGES)
                + ["buy now"]
            )
        if kind == "sub":
            return ["back to search", "< prev"]
        return []

    def _admissible(self) -> list[str]:
        if self._page[0] == "search":  # the query a shopper would type first: the instruction itself
            return [f"search[{self._goal['instruction_text']}]"]
        return [f"click[{b}]" for b in self._buttons()]

    def _render(self) -> str:
        kind = self._page[0]
        products = load_catalogue(self.folder).products
        if kind == "search":
            return _join(["WebShop", "Instruction:", self._goal["instruction_text"], "Search"])
        if kind == "results":
            page = self._page[1]
            parts = ["Back to Search", f"Page {page + 1} (Total results: {len(self._results)})"]
            parts += (["< Prev"] if page else []) + (["Next >"] if (page + 1) * PAGE_SIZE < len(self._results) else [])
            for asin in self._results[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]:
                parts += [asin, products[asin].title, products[asin].price_tag]
            return _join(parts)
        product = products[self._page[1]]
        if kind == "sub":
            body = {
                "description": product.description,
                "features": "\n".join(product.bullets),
                "reviews": "No reviews.",
            }[self._page[2]]
            return _join(["Back to Search", "< Prev", body])
        parts = ["Back to Search", "< Prev"]
        for name, values in product.options.items():
            parts += [name] + [f"[{v}]" if self._chosen.get(name) == v else v for v in values]
        parts += [
            product.title,
            f"Price: {product.price_tag}",
            f"Rating: {product.rating}",
            "Description",
            "Features",
            "Reviews",
            "Buy Now",
        ]
        return _join(parts)

    def step(self, action: str) -> Step:
        action = action.strip()
        m = re.fullmatch(r"(search|click)\[(.+)\]", action, flags=re.S)
        verb, arg = (m.group(1), m.group(2).strip()) if m else ("", "")
        kind = self._page[0]
        if verb == "search" and kind == "search":
            self._results = search(self.folder, arg)
            self._history, self._page = [], ("results", 0)
        elif verb == "click" and arg.lower() in self._buttons():
            arg = arg.lower()
            if arg == "buy now":
                product = load_catalogue(self.folder).products[self._page[1]]
                r = reward(product, self._goal, self._chosen)
                return Step(
                    observation=f"Thank you for shopping with us! Your score: {r:.2f}",
                    reward=r,
                    done=True,
                    won=r >= 1.0,
                    valid=True,
                    admissible=[],
                )
            if arg == "back to search":
                self._page, self._history, self._results = ("search",), [], []
            elif arg == "< prev":
                page = self._page
                self._page = ("results", page[1] - 1) if page[0] == "results" else self._history.pop()
            elif arg == "next >":
                self._page = ("results", self._page[1] + 1)
            elif kind == "results":
                self._history.append(self._page)
                self._page, self._chosen = ("item", next(a for a in self._results if a.lower() == arg)), {}
            elif arg in SUB_PAGES:
                self._history.append(self._page)
                self._page = ("sub", self._page[1], arg)
            else:  # an option value on the item page
                product = load_catalogue(self.folder).products[self._page[1]]
                name = next(n for n, vs in product.options.items() if arg in vs)
                self._chosen[name] = arg
        else:
            return Step(
                observation=INVALID, reward=0.0, done=False, won=False, valid=False, admissible=self._admissible()
            )
        return Step(
            observation=self._render(), reward=0.0, done=False, won=False, valid=True, admissible=self._admissible()
        )

    def expert_action(self) -> str | None:
        """Search with the instruction, page through the results to the goal product (or search its name
        when it is not among them), pick each goal option, buy."""
        from rapidfuzz import fuzz

        goal, kind = self._goal, self._page[0]
        if kind == "search":
            query = goal["instruction_text"] if self._expert_pages == 0 else goal["name"]
            return f"search[{query}]"
        if kind == "sub":
            return "click[< prev]"
        if kind == "results":
            on_page = [a.lower() for a in self._results[self._page[1] * PAGE_SIZE : (self._page[1] + 1) * PAGE_SIZE]]
            if goal["asin"].lower() in on_page:
                return f"click[{goal['asin'].lower()}]"
            if "next >" in self._buttons():
                return "click[next >]"
            self._expert_pages += 1
            return "click[back to search]" if self._expert_pages == 1 else None
        if self._page[1] != goal["asin"]:
            return "click[< prev]"
        product = load_catalogue(self.folder).products[goal["asin"]]
        for wanted in goal["goal_options"]:
            for name, values in product.options.items():
                best = max(values, key=lambda v: fuzz.token_set_ratio(v, wanted))
                if fuzz.token_set_ratio(best, wanted) > 85 and self._chosen.get(name) != best:
                    return f"click[{best}]"
        return "click[buy now]"

    def close(self) -> None:
        self._goal = None


def create(cfg, expert: str | None) -> WebShopEnv:
    return WebShopEnv(cfg.data_dir or None)


def check_data(cfg, generated: bool = False) -> None:
    check_types(cfg, WebShopEnv(cfg.data_dir or None).tasks("train"))
