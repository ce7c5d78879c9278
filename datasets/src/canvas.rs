//! A tiny immediate-mode UI painter for the synthetic GUI world: filled boxes and bitmap text, each
//! widget recorded as an [`Element`] with the box it was drawn in.
//!
//! Text uses the public-domain 8x8 bitmap font of the `font8x8` crate, scaled by an integer factor, so
//! screens carry real, readable text with no font files and bit-identical output on every machine.

use font8x8::UnicodeFonts;
use image::{Rgb, RgbImage};

use crate::episode::Element;

pub const BACKGROUND: Rgb<u8> = Rgb([250, 250, 247]);
pub const INK: Rgb<u8> = Rgb([28, 28, 32]);
pub const WHITE: Rgb<u8> = Rgb([255, 255, 255]);
pub const HEADER: Rgb<u8> = Rgb([38, 84, 160]);
pub const ROW: Rgb<u8> = Rgb([226, 230, 238]);
pub const ACCENT: Rgb<u8> = Rgb([22, 140, 86]);
pub const FIELD: Rgb<u8> = Rgb([255, 255, 255]);

/// The two-colour mark [`Canvas::badged_widget`] draws: side-by-side stripes, or stacked ones (`across`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Badge {
    pub colors: [Rgb<u8>; 2],
    pub across: bool,
}

pub struct Canvas {
    pub img: RgbImage,
    pub elements: Vec<Element>,
    /// Glyph scale: a character is `8 * scale` pixels square.
    pub scale: u32,
    /// Layout grid in pixels (0: none): see [`Canvas::snap`].
    pub grid: i32,
}

impl Canvas {
    pub fn new(width: u32, height: u32) -> Self {
        let scale = (width.min(height) / 180).max(1);
        Self { img: RgbImage::from_pixel(width, height, BACKGROUND), elements: Vec::new(), scale, grid: 0 }
    }

    pub fn width(&self) -> i32 {
        self.img.width() as i32
    }

    pub fn height(&self) -> i32 {
        self.img.height() as i32
    }

    /// Fills `[x1, x2) x [y1, y2)`, clipped to the image.
    pub fn fill(&mut self, bbox: [i32; 4], color: Rgb<u8>) {
        let [x1, y1, x2, y2] = bbox;
        for y in y1.max(0)..y2.min(self.height()) {
            for x in x1.max(0)..x2.min(self.width()) {
                self.img.put_pixel(x as u32, y as u32, color);
            }
        }
    }

    /// Draws `s` with its top-left corner at `(x, y)` at glyph scale `scale`; characters outside the font
    /// draw as `?`.
    pub fn text(&mut self, x: i32, y: i32, s: &str, color: Rgb<u8>, scale: u32) {
        let (g, k) = (8 * scale as i32, scale as i32);
        for (i, c) in s.chars().enumerate() {
            let bitmap = font8x8::BASIC_FONTS.get(c).or_else(|| font8x8::BASIC_FONTS.get('?')).unwrap_or([0; 8]);
            let x0 = x + i as i32 * g;
            for (row, bits) in bitmap.iter().enumerate() {
                for col in 0..8 {
                    if bits & (1 << col) != 0 {
                        let (px, py) = (x0 + col * k, y + row as i32 * k);
                        self.fill([px, py, px + k, py + k], color);
                    }
                }
            }
        }
    }

    /// Text inside a box: vertically centred, left-aligned with a margin (or centred when `center`), at
    /// the canvas scale or smaller so that it fits; at scale 1 a text that still does not fit is cut
    /// with `..` (the element list keeps the whole text, as accessibility trees do).
    pub fn label(&mut self, bbox: [i32; 4], s: &str, color: Rgb<u8>, center: bool) {
        let [x1, y1, x2, y2] = bbox;
        let room = |scale: u32| ((x2 - x1) / (8 * scale as i32)).max(1) as usize - 1;
        let mut scale = self.scale;
        while scale > 1 && s.chars().count() > room(scale) {
            scale -= 1;
        }
        let shown: String = if s.chars().count() > room(scale) {
            s.chars().take(room(scale).saturating_sub(2)).chain("..".chars()).collect()
        } else {
            s.to_string()
        };
        let (g, width) = (8 * scale as i32, 8 * scale as i32 * shown.chars().count() as i32);
        let y = (y1 + y2 - g) / 2;
        let x = if center { (x1 + x2 - width) / 2 } else { x1 + g / 2 };
        self.text(x, y, &shown, color, scale);
    }

    /// A widget: a filled box with a label, recorded in the element list. Returns its id.
    pub fn widget(&mut self, role: &str, bbox: [i32; 4], text: &str, bg: Rgb<u8>, fg: Rgb<u8>, center: bool) -> String {
        self.fill(bbox, bg);
        self.label(bbox, text, fg, center);
        self.record(role, bbox, text)
    }

    /// Lists a drawn widget in the element list; returns its id.
    fn record(&mut self, role: &str, bbox: [i32; 4], text: &str) -> String {
        let id = format!("e{}", self.elements.len());
        self.elements.push(Element { id: id.clone(), role: role.into(), text: text.into(), bbox });
        id
    }

    /// A widget with a badge: a square of two colour stripes (`badge`) beside the label, or, with
    /// `stacked` (app icons), above it. The element's box is the whole widget. On a layout grid the badge
    /// fills the middle of one grid cell (the first whole cell of the box), so that one patch-merged token
    /// of a model with that merge size sees all of it, each stripe in a patch of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn badged_widget(
        &mut self,
        role: &str,
        bbox: [i32; 4],
        text: &str,
        bg: Rgb<u8>,
        fg: Rgb<u8>,
        badge: &Badge,
        stacked: bool,
    ) -> String {
        let [x1, y1, x2, y2] = bbox;
        self.fill(bbox, bg);
        let side = if self.grid > 0 {
            self.grid
        } else if stacked {
            (y2 - y1) / 2
        } else {
            y2 - y1
        };
        let (cx, cy) = if self.grid > 0 { (self.snap(x1), self.snap(y1)) } else { (x1, y1) };
        let m = side / 7;
        let [bx1, by1, bx2, by2] = [cx + m, cy + m, cx + side - m, cy + side - m];
        let [c1, c2] = badge.colors;
        if badge.across {
            let mid = (by1 + by2) / 2;
            self.fill([bx1, by1, bx2, mid], c1);
            self.fill([bx1, mid, bx2, by2], c2);
        } else {
            let mid = (bx1 + bx2) / 2;
            self.fill([bx1, by1, mid, by2], c1);
            self.fill([mid, by1, bx2, by2], c2);
        }
        let label = if stacked { [x1, cy + side, x2, y2] } else { [cx + side, y1, x2, y2] };
        self.label(label, text, fg, stacked);
        self.record(role, bbox, text)
    }

    /// The title bar every screen has; not clickable, but listed (as a header) like a real a11y tree.
    pub fn header(&mut self, title: &str) {
        let h = if self.grid > 0 { (self.height() / 10 / self.grid).max(1) * self.grid } else { self.height() / 10 };
        self.widget("header", [0, 0, self.width(), h], title, HEADER, WHITE, false);
    }

    /// Box of list row `i` below the header (rows of equal height with gaps; on a grid, rows one grid
    /// cell tall or more, touching, starting on grid lines).
    pub fn row_box(&self, i: usize) -> [i32; 4] {
        let (w, h) = (self.width(), self.height());
        let (top, rh, gap) = (h / 10 + h / 40, h / 11, h / 60);
        let (top, pitch, rh) =
            if self.grid > 0 { (self.snap(top), self.snap(rh), self.snap(rh)) } else { (top, rh + gap, rh) };
        let y1 = top + i as i32 * pitch;
        [w / 20, y1, w - w / 20, y1 + rh]
    }

    /// How many list rows fit on the screen (row `i` fits when its box ends inside it).
    pub fn rows_that_fit(&self) -> usize {
        (0..).take_while(|&i| self.row_box(i)[3] <= self.height()).count()
    }

    /// `v` rounded up to the layout grid (unchanged without one).
    pub fn snap(&self, v: i32) -> i32 {
        if self.grid > 0 {
            (v + self.grid - 1) / self.grid * self.grid
        } else {
            v
        }
    }

    pub fn element(&self, id: &str) -> &Element {
        self.elements.iter().find(|e| e.id == id).expect("element ids come from this canvas")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_draws_ink_inside_its_box_only() {
        let mut c = Canvas::new(360, 640);
        assert_eq!(c.scale, 2);
        let id = c.widget("button", [20, 100, 200, 150], "Oat milk", ROW, INK, false);
        let e = c.element(&id).clone();
        let ink = |x1: i32, y1: i32, x2: i32, y2: i32| {
            (y1..y2)
                .flat_map(|y| (x1..x2).map(move |x| (x, y)))
                .filter(|&(x, y)| c.img.get_pixel(x as u32, y as u32) == &INK)
                .count()
        };
        assert!(ink(e.bbox[0], e.bbox[1], e.bbox[2], e.bbox[3]) > 100, "no text drawn in the box");
        assert_eq!(ink(0, 0, 360, 100) + ink(0, 150, 360, 640), 0, "ink outside the box");
        assert_eq!(c.img.get_pixel(21, 101), &ROW);
        assert_eq!(c.img.get_pixel(19, 99), &BACKGROUND);
    }
}
