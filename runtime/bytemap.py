"""The byte map of one page: which field every byte of a format's page belongs to, and a PNG of it."""

from __future__ import annotations

import numpy as np

# category id -> (label, colour)
CATEGORIES = {
    0: ("padding", "#d9d9d9"),
    1: ("K data", "#2b6cb0"),
    2: ("K scale", "#90cdf4"),
    3: ("K zero point", "#b794f4"),
    4: ("V data", "#c05621"),
    5: ("V scale", "#fbd38d"),
    6: ("V zero point", "#f687b3"),
}
_FIELD_CATEGORY = {"k_data": 1, "k_scale": 2, "k_zp": 3, "v_data": 4, "v_scale": 5, "v_zp": 6}


def page_map(layout, block_size: int, num_kv_heads: int, head_size: int) -> dict[str, np.ndarray]:
    """tensor -> uint8 array of one page's bytes, each holding the category id of the field it belongs to."""
    lay = layout.page_layout(block_size, num_kv_heads, head_size)
    maps = {t: np.zeros(n, dtype=np.uint8) for t, n in lay["page_bytes"].items()}
    regions = {name: (tensor, region) for name, tensor, region, *_ in layout.FIELDS}
    for name, f in lay["fields"].items():
        page = maps[f["tensor"]]
        rows_per = getattr(layout, "ROWS_PER", {}).get(regions[name], 1)  # KIVI key groups: a row per G tokens
        for cell in range(block_size // rows_per * num_kv_heads):
            start = f["base"] + cell * f["cell"]
            page[start:start + f["bytes"]] = _FIELD_CATEGORY[name]
    return maps


def draw(fmt, path: str, block_size: int, num_kv_heads: int, head_size: int) -> None:
    """Write a PNG of one page per tensor: bytes left to right, rows top to bottom, offsets on the left."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    maps = page_map(fmt.layout, block_size, num_kv_heads, head_size)
    lay = fmt.layout.page_layout(block_size, num_kv_heads, head_size)
    cmap = ListedColormap([CATEGORIES[i][1] for i in sorted(CATEGORIES)])
    fig, axes = plt.subplots(len(maps), 1, figsize=(11, 2.2 + 3.2 * len(maps)), squeeze=False)
    for ax, (tensor, page) in zip(axes[:, 0], maps.items()):
        width = max(lay["regions"][tensor])  # one row = the widest cell of the tensor
        rows = -(-page.size // width)
        grid = np.full(rows * width, 0, dtype=np.uint8)
        grid[:page.size] = page
        img = grid.reshape(rows, width).astype(float)
        if rows * width > page.size:
            img.reshape(-1)[page.size:] = np.nan  # past the end of the page
        ax.imshow(img, cmap=cmap, vmin=-0.5, vmax=len(CATEGORIES) - 0.5, aspect="auto", interpolation="nearest")
        if rows <= 64:  # separate the rows (cells) with thin lines
            ax.hlines([r + 0.5 for r in range(rows - 1)], -0.5, width - 0.5, colors="white", linewidth=0.6)
        step = max(1, rows // 16)
        ax.set_yticks(range(0, rows, step))
        ax.set_yticklabels([f"{r * width:,}" for r in range(0, rows, step)], fontsize=7)
        ax.set_ylabel("byte offset of row")
        ax.set_xlabel(f"byte within row (row = {width} B)")
        ax.set_title(f"{tensor}: one page = {page.size:,} B ({block_size} slots x {num_kv_heads} KV heads, "
                     f"head size {head_size})", fontsize=10)
    used = sorted(set(np.concatenate(list(maps.values())).tolist()))
    fig.legend(handles=[Patch(color=CATEGORIES[i][1], label=CATEGORIES[i][0]) for i in used],
               loc="lower center", ncol=len(used), frameon=False)
    fig.suptitle(f"kvgen format {fmt.name}: byte map of one page", fontsize=12)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
