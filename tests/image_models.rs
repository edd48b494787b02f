//! The image models' networks (CLIP's and SigLIP's towers, ViT's classifier, candle) against
//! what transformers computed for the fixture photographs and texts
//! (tests/fixtures/images/reference.json), from this crate's own preprocessing.

mod common;

use candle_core::DType::F32;
use common::floats;
use spotinfer::model::engines::towers::ImageModel;
use spotinfer::model::image::decode::decode;
use spotinfer::model::ImageTask;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images")
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (norm(a) * norm(b))
}

/// The largest difference between two lists of probabilities, element by element.
fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

fn model(name: &str) -> ImageModel {
    ImageModel::load(
        &fixtures().join("models").join(name),
        &candle_core::Device::Cpu,
    )
    .unwrap()
}

/// Every photograph's pixel values, decoded and preprocessed here, by name.
fn pixel_values(m: &ImageModel) -> Vec<(String, Vec<f32>)> {
    let refs = reference();
    refs["photos"]
        .as_object()
        .unwrap()
        .keys()
        .map(|name| {
            let bytes = std::fs::read(fixtures().join("photos").join(name)).unwrap();
            let img = decode(&bytes, 50_000_000).unwrap();
            (name.clone(), m.processor.pixel_values(&img).unwrap())
        })
        .collect()
}

/// CLIP and SigLIP: every photograph's image vector within cosine 0.99999 of transformers' (every
/// file, JPEG included, decodes to Pillow's bytes), every text's within 0.9999, from the token
/// ids transformers' tokenizer gave.
#[test]
fn clip_and_siglip_vectors_match_transformers() {
    let refs = reference();
    for name in ["clip", "siglip"] {
        let m = model(name);
        assert!(m.has_text());
        let photos = pixel_values(&m);
        let pixels: Vec<Vec<f32>> = photos.iter().map(|(_, p)| p.clone()).collect();
        let got = m.images(&pixels).unwrap();
        for ((photo, _), v) in photos.iter().zip(&got) {
            let want = floats(&refs["models"][name]["images"][photo.as_str()]);
            let c = cosine(v, &want);
            eprintln!("{name} {photo:28} cosine {c:.7}");
            assert!(c >= 0.99999, "{name} {photo}: cosine {c}");
        }
        let texts = refs["models"][name]["texts"].as_object().unwrap();
        let ids: Vec<Vec<u32>> = texts
            .values()
            .map(|t| {
                let ids: Vec<u32> = t["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect();
                ids
            })
            .collect();
        let got = m.texts(&ids).unwrap();
        for ((text, t), v) in texts.iter().zip(&got) {
            let c = cosine(v, &floats(&t["embedding"]));
            eprintln!("{name} text {text:?}: cosine {c:.7}");
            assert!(c >= 0.9999, "{name} {text:?}: cosine {c}");
        }
    }
}

/// ViT: every photograph's probabilities within 1e-3 of transformers' and the same top label
/// where the reference's top two are apart.
#[test]
fn vit_probabilities_match_transformers() {
    let refs = reference();
    let m = model("vit");
    assert!(!m.has_text());
    assert_eq!(m.labels, ["astronaut", "cat", "coffee", "rocket", "camera"]);
    let photos = pixel_values(&m);
    let pixels: Vec<Vec<f32>> = photos.iter().map(|(_, p)| p.clone()).collect();
    let logits = m.images(&pixels).unwrap();
    for ((photo, _), l) in photos.iter().zip(&logits) {
        let most = l.iter().cloned().fold(f32::MIN, f32::max);
        let e: Vec<f32> = l.iter().map(|x| (x - most).exp()).collect();
        let sum: f32 = e.iter().sum();
        let probs: Vec<f32> = e.iter().map(|x| x / sum).collect();
        let want = &refs["models"]["vit"]["images"][photo.as_str()];
        let wp = floats(&want["probabilities"]);
        let diff = largest_difference(&probs, &wp);
        eprintln!("vit {photo:28} max probability difference {diff:.2e}");
        assert!(diff <= 1e-3, "{photo}: {probs:?} against {wp:?}");
        let mut sorted = wp.clone();
        sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
        if sorted[0] - sorted[1] > 0.01 {
            let top = probs
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.partial_cmp(b.1).unwrap())
                .unwrap()
                .0;
            assert_eq!(m.labels[top], want["label"].as_str().unwrap(), "{photo}");
        }
    }
    let err = m
        .texts(&[vec![1, 2, 3]])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("no text tower"), "{err}");
}

/// The image task as the worker loads it: CLIP's and SigLIP's texts tokenized from the folder's
/// `tokenizer.json` as transformers did (the same ids, padding aside), a text past the tower's
/// positions truncated rather than failed, and the load options that mean nothing for an image
/// model refused with the reason.
#[test]
fn the_image_task_tokenizes_as_transformers_and_refuses_text_model_options() {
    use spotinfer::model::{
        Backend, DeviceChoice, Item, LoadOptions, Predict, PromptChoice, Reads, Text,
    };
    let refs = reference();
    for name in ["clip", "siglip"] {
        let task = ImageTask::open(
            &fixtures().join("models").join(name),
            &LoadOptions::new(DeviceChoice::Cpu),
        )
        .unwrap();
        assert_eq!(task.info().reads, Reads::ImagesAndTexts);
        let texts = refs["models"][name]["texts"].as_object().unwrap();
        let items: Vec<Item> = texts
            .keys()
            .map(|t| Item::Text(Text::from(t.clone())))
            .collect();
        let got = task.predict_items(&items).unwrap().outputs;
        for ((text, t), out) in texts.iter().zip(&got) {
            let spotinfer::model::Output::Embedding(v) = out else {
                panic!("{out:?}")
            };
            let c = cosine(v, &floats(&t["embedding"]));
            assert!(c >= 0.9999, "{name} {text:?}: cosine {c}");
        }
        let long = "a very long caption about an astronaut ".repeat(40);
        let out = task.predict_items(&[Item::Text(Text::from(long))]).unwrap();
        assert!(
            out.outputs[0].is_finite(),
            "{name}: a long text is truncated"
        );
    }
    let vit = ImageTask::open(
        &fixtures().join("models/vit"),
        &LoadOptions::new(DeviceChoice::Cpu),
    )
    .unwrap();
    assert_eq!(vit.info().reads, Reads::Images);
    let dir = fixtures().join("models/clip");
    for (options, says) in [
        (
            LoadOptions::new(DeviceChoice::Cpu).backend(Backend::Fused),
            "--backend fused",
        ),
        (
            LoadOptions {
                prompt: PromptChoice::Text("query: ".into()),
                ..LoadOptions::new(DeviceChoice::Cpu)
            },
            "--prompt",
        ),
    ] {
        let err = ImageTask::open(&dir, &options).err().unwrap().to_string();
        assert!(err.contains(says), "{err}");
    }
}

/// CLIP's and ViT's image towers on the CPU encoder's kernels (the CPU default) in f32 against
/// transformers, with the same bars as candle's, and against candle's towers on the same pixel
/// values (a lossless comparison: the same input, two engines). f32 is asked for: under auto,
/// CLIP's tower computes in bf16 where the CPU has AMX (the test below).
#[test]
fn the_cpu_image_towers_match_transformers_and_candle() {
    use spotinfer::model::{DeviceChoice, LoadOptions, Precision};
    let f32 = LoadOptions::new(DeviceChoice::Cpu).precision(Precision::F32);
    towers_match_transformers_and_candle(&f32, "fused image tower");
}

/// The same on the unpadded encoder's operations (`--backend unpadded`, issue 51's image
/// towers), run on candle's CPU backend through the kernels' references: the packed graph
/// computes what candle's towers and transformers compute.
#[test]
fn the_unpadded_image_towers_match_transformers_and_candle() {
    use spotinfer::model::{Backend, DeviceChoice, LoadOptions};
    let unpadded = LoadOptions::new(DeviceChoice::Cpu).backend(Backend::Unpadded);
    towers_match_transformers_and_candle(&unpadded, "unpadded image tower");
    // Element by element: every output of a batch of all the photographs, and one of them
    // alone, against candle's towers, relative to the largest output.
    for name in ["clip", "vit"] {
        let dir = fixtures().join("models").join(name);
        let candle = model(name);
        let packed = ImageModel::load_unpadded(&dir, &candle_core::Device::Cpu, F32).unwrap();
        let pixels: Vec<Vec<f32>> = pixel_values(&candle).into_iter().map(|(_, p)| p).collect();
        let (want, got) = (
            candle.images(&pixels).unwrap(),
            packed.images(&pixels).unwrap(),
        );
        let alone = packed.images(&pixels[3..4]).unwrap();
        let scale = want.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        let worst = want
            .iter()
            .zip(&got)
            .chain([(&want[3], &alone[0])])
            .map(|(w, g)| largest_difference(w, g) / scale)
            .fold(0f32, f32::max);
        eprintln!(
            "{name}: {} pictures, largest difference {worst:.2e} of the largest output",
            pixels.len()
        );
        assert!(worst <= 1e-5, "{name}: {worst}");
    }
    let err = ImageTask::open(&fixtures().join("models/siglip"), &unpadded)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("SigLIP") && err.contains("--backend candle"),
        "{err}"
    );
}

/// CLIP's and ViT's photographs through the image task loaded with `options` (whose device
/// description contains `says`): within the bars of transformers' outputs, and vectors within
/// cosine 0.99999 of candle's towers on the same pixel values.
fn towers_match_transformers_and_candle(options: &spotinfer::model::LoadOptions, says: &str) {
    use spotinfer::model::{Item, Output, Predict};
    let refs = reference();
    for name in ["clip", "vit"] {
        let dir = fixtures().join("models").join(name);
        let task = ImageTask::open(&dir, options).unwrap();
        assert!(task.info().device.contains(says), "{}", task.info().device);
        let candle = model(name);
        let photos = pixel_values(&candle);
        let items: Vec<Item> = photos
            .iter()
            .map(|(_, p)| Item::Pixels(p.clone().into()))
            .collect();
        let got = task.predict_items(&items).unwrap().outputs;
        let pixels: Vec<Vec<f32>> = photos.iter().map(|(_, p)| p.clone()).collect();
        let by_candle = candle.images(&pixels).unwrap();
        for (((photo, _), out), c) in photos.iter().zip(&got).zip(&by_candle) {
            match out {
                Output::Embedding(v) => {
                    let want = floats(&refs["models"][name]["images"][photo.as_str()]);
                    let (t, k) = (cosine(v, &want), cosine(v, c));
                    eprintln!("{name} {photo:28} cosine {t:.7} to transformers, {k:.7} to candle");
                    assert!(t >= 0.99999 && k >= 0.99999, "{name} {photo}: {t} {k}");
                }
                Output::Classes { scores, .. } => {
                    let want =
                        floats(&refs["models"][name]["images"][photo.as_str()]["probabilities"]);
                    let diff = largest_difference(scores, &want);
                    eprintln!("{name} {photo:28} max probability difference {diff:.2e}");
                    assert!(diff <= 1e-3, "{name} {photo}: {diff}");
                }
                other => panic!("{other:?}"),
            }
        }
    }
}

/// bf16 and int8 on the CPU image tower, when asked: each is checked at load against f32 on the
/// probe pictures and either refused with the cosine it reached (ViT's int8 here: 0.9988) or
/// stays within the bars on the photographs (vectors within cosine 0.999 of transformers',
/// probabilities within 1e-2). CLIP's int8 must load wherever the CPU has an int8 kernel.
#[test]
fn reduced_precisions_on_the_cpu_image_tower_are_checked_and_close() {
    use spotinfer::model::{DeviceChoice, LoadOptions, Precision, Predict};
    let refs = reference();
    for precision in [Precision::Bf16, Precision::Int8] {
        for name in ["clip", "vit"] {
            let dir = fixtures().join("models").join(name);
            let options = LoadOptions {
                precision,
                ..LoadOptions::new(DeviceChoice::Cpu)
            };
            let task = match ImageTask::open(&dir, &options) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("{name} {precision:?}: {e}");
                    assert!(e.to_string().contains("--precision"), "{e}");
                    let int8 =
                        precision == Precision::Int8 && spotinfer_fused_cpu::int8_supported();
                    assert!(!(name == "clip" && int8), "CLIP int8 refused: {e}");
                    continue;
                }
            };
            let worst = close_to_transformers(name, &task, &refs);
            eprintln!(
                "{name} {precision:?} on {}: worst {worst:.2e}",
                task.info().device
            );
        }
    }
}

/// Under `--precision auto`, CLIP's CPU image tower computes in bf16 on AMX tiles where the CPU
/// has them (the probe pictures held at load), and in f32 elsewhere; ViT, a classifier, stays
/// f32 everywhere. Either way the photographs stay within the bars of transformers' outputs.
#[test]
fn auto_puts_clips_image_tower_on_amx_tiles_and_keeps_vit_in_f32() {
    use spotinfer::model::{DeviceChoice, LoadOptions, Predict};
    let refs = reference();
    for name in ["clip", "vit"] {
        let dir = fixtures().join("models").join(name);
        let task = ImageTask::open(&dir, &LoadOptions::new(DeviceChoice::Cpu)).unwrap();
        let device = task.info().device.clone();
        let tiles = name == "clip" && spotinfer_fused_cpu::amx_supported();
        assert_eq!(
            device.contains("Bf16 on AMX-BF16"),
            tiles,
            "{name}: {device}"
        );
        assert_eq!(device.contains("F32 on"), !tiles, "{name}: {device}");
        let worst = close_to_transformers(name, &task, &refs);
        eprintln!("{name} auto on {device}: worst {worst:.2e}");
    }
}

/// `task`'s outputs for fixture `name`'s photographs against transformers': image vectors
/// within cosine 0.999, class probabilities within 1e-2. Returns the worst distance (1 - cosine,
/// or the largest probability difference).
fn close_to_transformers(
    name: &str,
    task: &spotinfer::model::ImageTask,
    refs: &serde_json::Value,
) -> f32 {
    use spotinfer::model::{Item, Output, Predict};
    let photos = pixel_values(&model(name));
    let items: Vec<Item> = photos
        .iter()
        .map(|(_, p)| Item::Pixels(p.clone().into()))
        .collect();
    let got = task.predict_items(&items).unwrap().outputs;
    let mut worst = 0f32;
    for ((photo, _), out) in photos.iter().zip(&got) {
        let want = &refs["models"][name]["images"][photo.as_str()];
        match out {
            Output::Embedding(v) => {
                let c = cosine(v, &floats(want));
                worst = worst.max(1.0 - c);
                assert!(c >= 0.999, "{name} {photo}: cosine {c}");
            }
            Output::Classes { scores, .. } => {
                let p = floats(&want["probabilities"]);
                let d = largest_difference(scores, &p);
                worst = worst.max(d);
                assert!(d <= 1e-2, "{name} {photo}: {d}");
            }
            other => panic!("{other:?}"),
        }
    }
    worst
}
