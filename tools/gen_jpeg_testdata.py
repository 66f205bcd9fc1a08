#!/usr/bin/env python3
"""Writes tests/testdata/jpeg/: small JPEG variants and PIL's decodes of
them, which tests/data/jpeg_reference_test.cpp compares ddptrain's decoder
against.

    /usr/bin/python3 tools/gen_jpeg_testdata.py     (needs PIL and jpegtran:
                                                     apt-get install python3-pil libjpeg-turbo-progs)

One 37 x 23 picture (odd sides, so every scaled size is rounded up; smooth
gradients with a sharp-edged square, so chroma subsampling shows) is saved
as each variant a decoder meets in photo collections:

  baseline_420.jpg   baseline, 4:2:0 chroma (PIL's default)
  baseline_422.jpg   4:2:2
  baseline_444.jpg   4:4:4
  progressive.jpg    progressive, 4:2:0
  restart.jpg        baseline_420.jpg with a restart marker after every MCU
                     (jpegtran -restart 1B: lossless, same coefficients)
  gray.jpg           one channel
  cmyk_adobe.jpg     CMYK (black ink rising left to right) as PIL and Adobe
                     software write it: inverted, with Adobe's APP14 marker
  cmyk_no_adobe.jpg  the same bytes without the APP14 marker
  truncated.jpg      baseline_420.jpg cut inside its entropy-coded data

For each decodable file, reference.json lists its size and PNGs (lossless,
so the pixels are exact) of PIL's decode converted to RGB, at full size and
through Image.draft() at 1/2, 1/4 and 1/8 scale. PIL links the same
libjpeg-turbo as ddptrain (Debian's), so the expected difference is zero.
"""
import io
import json
import os
import subprocess

import PIL
from PIL import Image, JpegImagePlugin

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "testdata", "jpeg")
W, H = 37, 23


def picture():
    im = Image.new("RGB", (W, H))
    px = im.load()
    for y in range(H):
        for x in range(W):
            r = 30 + 200 * x // (W - 1)
            g = 220 - 180 * y // (H - 1)
            b = 128 + int(90 * ((x - y) % 11) / 10) - 45
            if 9 <= x < 21 and 5 <= y < 15:  # a saturated square with hard edges
                r, g, b = 240, 40, 200
            px[x, y] = (r, g, b)
    return im


def cmyk(rgb):
    """The picture in CMYK with black ink rising left to right (PIL's own
    RGB-to-CMYK conversion leaves K at 0, which would not test it)."""
    c, m, y = (Image.eval(band, lambda v: 255 - v) for band in rgb.split())
    k = Image.new("L", rgb.size)
    k.putdata([140 * x // (W - 1) for y in range(H) for x in range(W)])
    return Image.merge("CMYK", (c, m, y, k))


def strip_app14(data):
    """The JPEG bytes without their Adobe APP14 segment (FF EE, length, 'Adobe')."""
    i = data.find(b"\xff\xee")
    while i >= 0 and data[i + 4:i + 9] != b"Adobe":
        i = data.find(b"\xff\xee", i + 2)
    assert i >= 0, "no Adobe marker to strip"
    length = int.from_bytes(data[i + 2:i + 4], "big")
    return data[:i] + data[i + 2 + length:]


def libjpeg_turbo_version():
    """The libjpeg-turbo that PIL's decoder is linked against, from the package manager."""
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "libjpeg62-turbo"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def save(name, data):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)


def encode(im, **kw):
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def main():
    os.makedirs(OUT, exist_ok=True)
    rgb = picture()
    files = {
        "baseline_420.jpg": encode(rgb, subsampling=2),
        "baseline_422.jpg": encode(rgb, subsampling=1),
        "baseline_444.jpg": encode(rgb, subsampling=0),
        "progressive.jpg": encode(rgb, subsampling=2, progressive=True),
        "gray.jpg": encode(rgb.convert("L")),
        "cmyk_adobe.jpg": encode(cmyk(rgb)),
    }
    files["restart.jpg"] = subprocess.run(["jpegtran", "-restart", "1B", "-copy", "none"],
                                          input=files["baseline_420.jpg"], capture_output=True, check=True).stdout
    files["cmyk_no_adobe.jpg"] = strip_app14(files["cmyk_adobe.jpg"])
    base = files["baseline_420.jpg"]
    sos = base.find(b"\xff\xda")
    # Halfway into the scan data: libjpeg only warns there, and pads with grey.
    files["truncated.jpg"] = base[:sos + (len(base) - sos) // 2]

    # The variants really are what their names say.
    def opened(name):
        return Image.open(io.BytesIO(files[name]))
    sampling = JpegImagePlugin.get_sampling
    assert sampling(opened("baseline_420.jpg")) == 2
    assert sampling(opened("baseline_422.jpg")) == 1
    assert sampling(opened("baseline_444.jpg")) == 0
    assert opened("progressive.jpg").info.get("progressive") and "progressive" not in opened("baseline_420.jpg").info
    assert b"\xff\xdd" in files["restart.jpg"] and b"\xff\xd0" in files["restart.jpg"]
    assert b"\xff\xdd" not in base
    assert opened("gray.jpg").mode == "L"
    assert opened("cmyk_adobe.jpg").mode == "CMYK" and "adobe" in opened("cmyk_adobe.jpg").info
    assert opened("cmyk_no_adobe.jpg").mode == "CMYK" and "adobe" not in opened("cmyk_no_adobe.jpg").info
    try:
        opened("truncated.jpg").load()
        raise AssertionError("PIL decoded truncated.jpg")
    except OSError as e:
        assert "truncated" in str(e), e

    for old in os.listdir(OUT):
        os.remove(os.path.join(OUT, old))
    pngs = {}  # decoded pixels -> the PNG that holds them: equal decodes share one file

    def reference_png(im, name):
        key = (im.size, im.tobytes())
        if key not in pngs:
            im.save(os.path.join(OUT, name), optimize=True)
            pngs[key] = name
        return pngs[key]

    images = []
    for name in sorted(files):
        save(name, files[name])
        if name == "truncated.jpg":
            continue
        stem = name[:-4]
        full = opened(name).convert("RGB")
        entry = {"file": name, "width": full.width, "height": full.height,
                 "reference": reference_png(full, stem + ".png"), "scaled": []}
        for denom in (2, 4, 8):
            im = opened(name)
            # draft() picks the largest scale with size // request >= scale.
            im.draft(im.mode, (W // denom, H // denom))
            assert im.decoderconfig == (denom, 0), (name, denom, im.decoderconfig)
            small = im.convert("RGB")
            want = (-(-W // denom), -(-H // denom))
            assert small.size == want, (name, denom, small.size)
            entry["scaled"].append({"denominator": denom, "width": small.width, "height": small.height,
                                    "reference": reference_png(small, f"{stem}_1_{denom}.png")})
        images.append(entry)
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        f.write('{"generator": "tools/gen_jpeg_testdata.py", "pil": "%s", "libjpeg_turbo": "%s",\n "images": [\n  '
                % (PIL.__version__, libjpeg_turbo_version()))
        f.write(",\n  ".join(json.dumps(e) for e in images))
        f.write("\n]}\n")
    total = sum(os.path.getsize(os.path.join(OUT, n)) for n in os.listdir(OUT))
    print(f"wrote {len(os.listdir(OUT))} files, {total} bytes, to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
