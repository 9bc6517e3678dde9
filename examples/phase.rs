use idem::policy::Policy;
use idem::protocol::{self, Claimed, Ctx, Flow};
use std::time::Instant;
fn main() {
    let db = std::path::Path::new("/tmp/pb/s.db");
    let policy = Policy::embedded();
    for i in 0..1 {
        let text = format!(
            r#"{{"client_id":"c","endpoint":"/t","idem_key":"ph-{}-{i}","body":{{"src":"A","dst":"B","amount":1,"currency":"KRW"}}}}"#,
            std::process::id()
        );
        let req = idem::request::parse(text.as_bytes(), policy).unwrap();
        let t = Instant::now();
        let conn =
            rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE).unwrap();
        let t1 = t.elapsed();
        drop(conn);
        let mut store = idem::store::sqlite::SqliteStore::open_for_one_request(db, policy).unwrap();
        let t2 = t.elapsed();
        let ctx = Ctx { policy, now: idem::clock::Timestamp::now(), token: "x" };
        assert_eq!(protocol::claim(&mut store, &req, ctx).unwrap(), Claimed::Mine);
        let t3 = t.elapsed();
        protocol::execute(&mut store, &req, ctx, &mut |_| Flow::Continue).unwrap();
        let t4 = t.elapsed();
        drop(store);
        let t5 = t.elapsed();
        println!(
            "open {:?} init {:?} claim {:?} execute {:?} close {:?}",
            t1,
            t2 - t1,
            t3 - t2,
            t4 - t3,
            t5 - t4
        );
    }
}
