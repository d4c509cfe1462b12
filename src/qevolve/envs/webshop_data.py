"""A small synthetic WebShop catalogue and goals, written in exactly the schema of WebShop's files.

The official files cannot be fetched on machines without internet; this one feeds the tests and the
demo. Five categories of six product types each, with brands, attributes, customisation options and
prices; each product gets one or two shopper instructions naming some of its attributes and options.
Products of one type share most attributes, so the search returns look-alikes and the right options
matter. `splits/` beside the files holds an 80/20 train/test split of the goal indices.
"""

from __future__ import annotations

import random
from pathlib import Path

from qevolve.data.atomic import write_json

CATEGORIES = {
    "beauty": {
        "path": "Beauty & Personal Care › Skin & Hair Care",
        "types": ["shampoo", "conditioner", "face cream", "lip balm", "body lotion", "hair oil"],
        "attributes": [
            "paraben free",
            "cruelty free",
            "long lasting",
            "natural ingredients",
            "sensitive skin",
            "travel size",
        ],
        "options": {
            "size": ["2 ounce", "4 ounce", "8 ounce", "16 ounce"],
            "scent": ["lavender", "citrus", "coconut", "unscented"],
        },
    },
    "electronics": {
        "path": "Electronics › Accessories & Supplies",
        "types": ["wireless earbuds", "usb cable", "phone case", "power bank", "bluetooth speaker", "hdmi adapter"],
        "attributes": [
            "fast charging",
            "noise cancelling",
            "water resistant",
            "high speed",
            "easy install",
            "long battery life",
        ],
        "options": {"color": ["black", "white", "blue", "red"], "length": ["3 ft", "6 ft", "10 ft"]},
    },
    "fashion": {
        "path": "Clothing, Shoes & Jewelry › Men & Women",
        "types": ["t-shirt", "hoodie", "jeans", "sneakers", "summer dress", "rain jacket"],
        "attributes": ["machine wash", "slim fit", "long sleeve", "cotton spandex", "relaxed fit", "button closure"],
        "options": {
            "color": ["black", "navy", "red", "gray", "olive"],
            "size": ["small", "medium", "large", "x-large"],
        },
    },
    "food": {
        "path": "Grocery & Gourmet Food › Snacks & Beverages",
        "types": ["green tea", "protein bar", "coffee beans", "trail mix", "olive oil", "dark chocolate"],
        "attributes": ["gluten free", "sugar free", "non gmo", "keto friendly", "individually wrapped", "low carb"],
        "options": {
            "flavor": ["original", "vanilla", "sea salt", "honey"],
            "size": ["pack of 6", "pack of 12", "pack of 24"],
        },
    },
    "furniture": {
        "path": "Home & Kitchen › Furniture",
        "types": ["bookshelf", "office chair", "side table", "bed frame", "storage ottoman", "tv stand"],
        "attributes": [
            "easy assembly",
            "solid wood",
            "space saving",
            "high density foam",
            "metal frame",
            "living room",
        ],
        "options": {"color": ["white", "espresso", "natural oak", "gray"], "size": ["small", "medium", "large"]},
    },
}
BRANDS = ["acme", "nova", "zenith", "orchid", "summit", "harbor", "pioneer", "lumen", "cedar", "vela"]


def _product(rng: random.Random, i: int, category: str) -> tuple[dict, list[str]]:
    spec = CATEGORIES[category]
    kind = rng.choice(spec["types"])
    attributes = sorted(rng.sample(spec["attributes"], 3))
    brand = rng.choice(BRANDS).title()
    low = round(rng.uniform(5, 90), 2)
    pricing = f"${low}" if rng.random() < 0.7 else f"${low} - ${round(low * rng.uniform(1.1, 1.6), 2)}"
    options = {
        name: sorted(rng.sample(values, rng.randint(2, len(values)))) for name, values in spec["options"].items()
    }
    record = {
        "asin": f"B{i:09d}",
        "name": f"{brand} {kind.title()} - {attributes[0].title()}, {attributes[1].title()}",
        "category": category,
        "query": kind,
        "product_category": f"{spec['path']} › {kind.title()}",
        "pricing": pricing,
        "small_description": "\n".join(f"{a.capitalize()}." for a in attributes),
        "full_description": f"This {kind} by {brand} is {attributes[0]} and {attributes[1]}, and it is "
        f"{attributes[2]}.",
        "customization_options": {
            name.title(): [{"value": v, "image": None} for v in vs] for name, vs in options.items()
        },
        "images": [f"https://example.invalid/{i}.jpg"],
        "average_rating": None,
        "Reviews": [],
    }
    return record, attributes


def _instruction(rng: random.Random, record: dict, attributes: list[str]) -> dict:
    kind = record["query"]
    wanted = sorted(rng.sample(attributes, rng.randint(1, 2)))
    options = {n.lower(): [v["value"] for v in vs] for n, vs in record["customization_options"].items()}
    picked = [rng.choice(vs) for vs in options.values()][: rng.randint(1, len(options))]
    text = f"i am looking for {' and '.join(wanted)} {kind}" + "".join(f", {o}" for o in picked)
    return {
        "asin": record["asin"],
        "instruction": text,
        "instruction_attributes": wanted,
        "instruction_options": picked,
    }


def write_synthetic(folder: Path | str, products: int = 200, seed: int = 0) -> dict:
    """Write the three WebShop files and `splits/` into `folder`; return the counts."""
    folder = Path(folder)
    rng = random.Random(seed)
    items, attrs, human = [], {}, {}
    for i in range(products):
        record, attributes = _product(rng, i, list(CATEGORIES)[i % len(CATEGORIES)])
        items.append(record)
        attrs[record["asin"]] = {"attributes": attributes, "instruction": None, "instruction_attributes": []}
        human[record["asin"]] = [_instruction(rng, record, attributes) for _ in range(rng.randint(1, 2))]
    goals = sum(len(v) for v in human.values())
    order = list(range(goals))
    rng.shuffle(order)
    cut = int(goals * 0.8)
    write_json(folder / "items_shuffle_1000.json", items)
    write_json(folder / "items_ins_v2_1000.json", attrs)
    write_json(folder / "items_human_ins.json", human)
    write_json(folder / "splits" / "train_indices.json", sorted(order[:cut]))
    write_json(folder / "splits" / "test_indices.json", sorted(order[cut:]))
    return {"products": products, "goals": goals, "train": cut, "test": goals - cut}
