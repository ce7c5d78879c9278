//! Images from requests: base64 (or data-URL) bytes -> a checked, decoded RGB image for the backend.
//!
//! The size check reads only the header (`into_dimensions`) BEFORE any pixel is decoded, so a small file
//! that claims 100000 x 100000 pixels (a decompression bomb) costs nothing; the decoder then runs with
//! allocation limits as a second fence. Decoding is CPU work: handlers call [`decode`] on actix's
//! blocking pool, never on a worker thread.

use std::io::Cursor;
use std::sync::Arc;

use askgui_runtime::content_hash;
use image::{ImageFormat, ImageReader, Limits};

use crate::backend::ImageInput;
use crate::error::HttpError;

/// Decodes PNG or JPEG bytes of at most `max_pixels` pixels. `what` names the field in messages.
pub fn decode(bytes: &[u8], max_pixels: u64, what: &str) -> Result<ImageInput, HttpError> {
    let reader = || {
        ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| HttpError::bad_request(format!("{what}: cannot read the image: {e}")))
    };
    let head = reader()?;
    match head.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg) => {}
        Some(other) => {
            return Err(HttpError::bad_request(format!("{what}: {other:?} images are not supported; send PNG or JPEG")))
        }
        None => return Err(HttpError::bad_request(format!("{what}: not an image (PNG or JPEG expected)"))),
    }
    let (w, h) = head
        .into_dimensions()
        .map_err(|e| HttpError::bad_request(format!("{what}: not a readable PNG or JPEG header: {e}")))?;
    let pixels = u64::from(w) * u64::from(h);
    if pixels == 0 {
        return Err(HttpError::bad_request(format!("{what}: the image is {w}x{h}, empty")));
    }
    if pixels > max_pixels {
        return Err(HttpError::bad_request(format!(
            "{what}: the image is {w}x{h} = {pixels} pixels, above this server's limit of {max_pixels} \
             (--max-image-pixels); scale the screenshot down"
        )));
    }
    let mut limits = Limits::default();
    limits.max_image_width = Some(w);
    limits.max_image_height = Some(h);
    // 16-bit RGBA is 8 bytes a pixel, the most a PNG or JPEG decodes to; plus slack for decoder buffers.
    limits.max_alloc = Some(pixels.saturating_mul(8).saturating_add(64 << 20));
    let mut decoder = reader()?;
    decoder.limits(limits);
    let image = decoder
        .decode()
        .map_err(|e| HttpError::bad_request(format!("{what}: the {w}x{h} image does not decode: {e}")))?
        .to_rgb8();
    Ok(ImageInput { image: Arc::new(image), hash: content_hash(bytes) })
}

/// The bytes of an OpenAI `image_url.url`: only `data:image/png|jpeg;base64,...` (the server fetches
/// nothing from the network).
pub fn data_url_bytes(url: &str, what: &str) -> Result<Vec<u8>, HttpError> {
    let url = url.trim();
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https:/") {
        return Err(HttpError::bad_request(format!(
            "{what}: this server does not fetch image URLs; send the image inline as a data URL \
             (data:image/png;base64,...)"
        )));
    }
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(HttpError::bad_request(format!("{what}: expected a data URL (data:image/png;base64,...)")));
    };
    let Some((meta, payload)) = rest.split_once(',') else {
        return Err(HttpError::bad_request(format!("{what}: a data URL without a `,`")));
    };
    let Some(mime) = meta.strip_suffix(";base64") else {
        return Err(HttpError::bad_request(format!("{what}: the data URL must be base64 (`;base64,`)")));
    };
    let mime = mime.to_ascii_lowercase();
    if !matches!(mime.as_str(), "image/png" | "image/jpeg" | "image/jpg") {
        return Err(HttpError::bad_request(format!(
            "{what}: `{}` is not supported; send image/png or image/jpeg",
            mime.chars().take(64).collect::<String>()
        )));
    }
    let bytes =
        askgui_data::convert::base64_decode(payload).map_err(|e| HttpError::bad_request(format!("{what}: {e}")))?;
    if bytes.is_empty() {
        return Err(HttpError::bad_request(format!("{what}: empty image")));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut out = Vec::new();
        image::RgbImage::new(w, h).write_to(&mut Cursor::new(&mut out), ImageFormat::Png).unwrap();
        out
    }

    #[test]
    fn decodes_and_checks_the_pixel_limit_first() {
        let img = decode(&png(7, 5), 35, "x").unwrap();
        assert_eq!(img.image.dimensions(), (7, 5));
        assert_eq!(img.hash, decode(&png(7, 5), 35, "x").unwrap().hash);
        let e = decode(&png(7, 5), 34, "shot").unwrap_err();
        assert!(e.message.contains("7x5 = 35 pixels") && e.message.contains("limit of 34"), "{}", e.message);
        assert!(decode(b"hello", 100, "x").unwrap_err().message.contains("not an image"));
        let mut truncated = png(40, 40);
        truncated.truncate(60);
        assert_eq!(decode(&truncated, 10_000, "x").unwrap_err().status.as_u16(), 400);
    }

    #[test]
    fn data_urls() {
        assert_eq!(data_url_bytes("data:image/png;base64,aGVsbG8=", "u").unwrap(), b"hello");
        assert_eq!(data_url_bytes("data:image/JPEG;base64,aGVsbG8", "u").unwrap(), b"hello");
        for bad in [
            "https://x/y.png",
            "HTTP://x",
            "data:text/plain;base64,aGk=",
            "data:image/png,abc",
            "aGk=",
            "data:image/png;base64,!!",
        ] {
            assert_eq!(data_url_bytes(bad, "u").unwrap_err().status.as_u16(), 400, "{bad}");
        }
        assert!(data_url_bytes("https://x/y.png", "u").unwrap_err().message.contains("data URL"));
    }
}
