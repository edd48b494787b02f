#!/usr/bin/env python3
"""The transformers side of examples/image_speed.rs: images/s of an image model folder on this
CPU, split into decode (Pillow: open, EXIF orientation, RGB, as load_image), preprocess (the
folder's processor, PIL backend) and network (PyTorch fp32, no_grad, batches).

    python bench/image_peer.py --model DIR --photos DIR [--batch 16] [--rounds 4]
    python bench/image_peer.py --make-model DIR      # CLIP ViT-B/32's shape, random weights
    python bench/image_peer.py --make-photos DIR     # scikit-image's photographs as JPEG, full size
    python bench/image_peer.py --make-large FROM DIR # those, upscaled to 4000 x 3000 (12 MP)

Prints one JSON line shaped like image_speed's.
"""
import argparse
import io
import json
import os
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_model(out):
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.CLIPModel(transformers.CLIPConfig())  # ViT-B/32: 224 px, 12 x 768
    model.save_pretrained(out)
    transformers.CLIPImageProcessorPil().save_pretrained(out)


def make_photos(out):
    """The sample photographs of scikit-image's wheel (fetched by tests/fixtures/images/
    make_images.py into .cache/fixtures), at their own sizes, as JPEG quality 90."""
    from PIL import Image
    wheel = sorted((ROOT / ".cache" / "fixtures").glob("scikit_image-0.26.0-*.whl"))[0]
    z = zipfile.ZipFile(wheel)
    os.makedirs(out, exist_ok=True)
    for name in ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png",
                 "motorcycle_left.png", "hubble_deep_field.jpg", "color.png"]:
        img = Image.open(io.BytesIO(z.read(f"skimage/data/{name}"))).convert("RGB")
        img.save(Path(out) / (Path(name).stem + ".jpg"), quality=90)
        print(name, img.size, file=sys.stderr)


def make_large(src, out):
    """The photographs of `src` at 4000 x 3000 pixels (12 megapixels, bicubic), JPEG quality 90:
    the largest images a worker run with --max-image-pixels 12000000 takes."""
    from PIL import Image
    os.makedirs(out, exist_ok=True)
    for f in sorted(os.listdir(src)):
        img = Image.open(Path(src) / f).convert("RGB").resize((4000, 3000), Image.BICUBIC)
        img.save(Path(out) / f, quality=90)
        print(f, (Path(out) / f).stat().st_size, file=sys.stderr)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--photos")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--make-model")
    p.add_argument("--make-photos")
    p.add_argument("--make-large", nargs=2, metavar=("FROM", "DIR"))
    a = p.parse_args()
    if a.make_large:
        return make_large(*a.make_large)
    if a.make_model:
        return make_model(a.make_model)
    if a.make_photos:
        return make_photos(a.make_photos)
    import numpy as np
    import torch
    import transformers
    from PIL import Image, ImageOps
    torch.set_num_threads(os.cpu_count())
    proc = transformers.AutoImageProcessor.from_pretrained(a.model, backend="pil")
    model = transformers.AutoModel.from_pretrained(a.model).eval()
    files = [(Path(a.photos) / f).read_bytes() for f in sorted(os.listdir(a.photos))] * a.rounds

    def features(pv):
        out = model.get_image_features(pixel_values=pv)
        return getattr(out, "pooler_output", out)
    with torch.no_grad():
        img = ImageOps.exif_transpose(Image.open(io.BytesIO(files[0]))).convert("RGB")
        features(torch.tensor(proc(images=img, return_tensors="np")["pixel_values"]))
        decode_s = prep_s = net_s = 0.0
        start = time.perf_counter()
        for i in range(0, len(files), a.batch):
            pixels = []
            for b in files[i:i + a.batch]:
                t = time.perf_counter()
                img = ImageOps.exif_transpose(Image.open(io.BytesIO(b))).convert("RGB")
                decode_s += time.perf_counter() - t
                t = time.perf_counter()
                pixels.append(proc(images=img, return_tensors="np")["pixel_values"][0])
                prep_s += time.perf_counter() - t
            t = time.perf_counter()
            features(torch.from_numpy(np.stack(pixels)))
            net_s += time.perf_counter() - t
        total = time.perf_counter() - start
    print(json.dumps({"images": len(files), "decode_s": decode_s, "preprocess_s": prep_s,
                      "network_s": net_s, "seconds": total, "images_per_s": len(files) / total,
                      "batch": a.batch, "torch": torch.__version__,
                      "transformers": transformers.__version__}))


if __name__ == "__main__":
    main()
