//! `askgui-serve`: the server binary (being built; see the crate docs).

fn main() {
    eprintln!("askgui-serve: the server is not built yet");
    std::process::exit(2);
}
